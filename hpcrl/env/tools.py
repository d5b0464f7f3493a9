"""Tool calls in a policy turn, in the Hermes format that Qwen2.5's and Qwen3's chat templates write.

    text = 'Let me compute.\\n<tool_call>\\n{"name": "python", "arguments": {"code": "print(2**10)"}}\\n</tool_call>'
    parse_tool_calls(text)     # [ToolCall(name="python", arguments={"code": "print(2**10)"}, error=None)]
    tool_message("1024\\n", name="python")   # {"role": "tool", "content": "1024\\n", "name": "python"}

The format (the templates' own system text, which tools_system_prompt writes):

    For each function call, return a json object with function name and arguments within
    <tool_call></tool_call> XML tags:
    <tool_call>
    {"name": <function-name>, "arguments": <args-json-object>}
    </tool_call>

Several calls in one turn are several blocks. Qwen's templates render a "tool" message as
<tool_response>...</tool_response> inside a user turn, so an environment answers each call with
tool_message. A block that is not such an object (bad JSON, no name, arguments not an object, no
closing tag) is a ToolCall with `error` set: the environment tells the model what was wrong in a tool
message rather than raising, since a malformed call is the policy's mistake, not the environment's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from hpcrl.env.types import Message

_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)

#: The templates' instructions after the tool list (Qwen2.5 / Qwen3 tokenizer_config.json chat_template).
_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
           "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
           "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
           "<args-json-object>}\n</tool_call>")


@dataclass(frozen=True)
class ToolCall:
    """One <tool_call> block: the call, or why it is not one."""

    name: str = ""
    arguments: dict = field(default_factory=dict)
    error: str | None = None
    """Why the block is not a call (shown to the model); None for a well-formed call."""


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every <tool_call> block of `text`, in order; [] when there is none (the turn is a final answer)."""
    calls = []
    for i, found in enumerate(_BLOCK.finditer(text)):
        body, closed = found.group(1).strip(), found.group(2)
        calls.append(_parse_one(body, i) if closed else
                     ToolCall(error=f"tool call {i + 1} has no closing </tool_call>"))
    return calls


def _parse_one(body: str, i: int) -> ToolCall:
    where = f"tool call {i + 1}"
    try:
        value = json.loads(body)
    except ValueError as err:
        return ToolCall(error=f"{where} is not valid JSON ({err}); write "
                              '{"name": <function-name>, "arguments": {...}}')
    if not isinstance(value, dict):
        return ToolCall(error=f"{where} is a JSON {type(value).__name__}, not an object with \"name\" and \"arguments\"")
    name, arguments = value.get("name"), value.get("arguments", {})
    if not isinstance(name, str) or not name:
        return ToolCall(error=f'{where} has no "name" (a string naming the tool)')
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI's API does
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(name=name, error=f'{where} ({name}): "arguments" is not a JSON object')
    return ToolCall(name=name, arguments=arguments)


def tool_message(content: str, *, name: str = "") -> Message:
    """A "tool" role message with a tool's output (or the reason a call was not run)."""
    message: Message = {"role": "tool", "content": content}
    if name:
        message["name"] = name
    return message


def tool_schema(name: str, description: str, parameters: dict) -> dict:
    """A tool as the chat templates list it: {"type": "function", "function": {name, description, parameters}}."""
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def tools_system_prompt(tools: list[dict], preamble: str = "") -> str:
    """The system text that Qwen's templates write for `tools=` (the preamble first), so an environment can
    describe its tools in a plain system message whatever the head's template does with `tools`."""
    listed = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (preamble + "\n\n" if preamble else "") + _HEADER + listed + _FOOTER
