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
closing tag, JSON nested deeper than MAX_DEPTH or longer than MAX_CALL_CHARS, text that is not Unicode) is a
ToolCall with `error` set: the environment tells the model what was wrong in a tool message rather than raising,
since a malformed call is the policy's mistake, not the environment's.

Every block counts, inside a `<think>` block too: that is what vLLM (0.32) finds serving Qwen3 with
`--reasoning-parser qwen3 --tool-call-parser hermes`, whose reasoning grammar (vllm/parser/qwen3.py) ends
the reasoning at a <tool_call>, so the hermes parser reads it as content (tests/data/test_real_templates.py
compares the two on Qwen3's tokenizer). A policy trained here calls tools as vLLM serves it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from hpcrl.env.types import Message

_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
#: What the depth count reads: brackets, and the quotes and backslashes that say whether one is inside a string.
_STRUCTURE = re.compile(r'[\[\]{}"\\]')
#: The deepest nesting of [] and {} a call may have: json.loads recurses per level (RecursionError at ~1,000).
MAX_DEPTH = 64
#: The longest call, in characters: far more than any real call, little enough to parse at once.
MAX_CALL_CHARS = 256 * 1024

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


def _json(text: str, where: str) -> tuple[object, str | None]:
    """`text` as JSON, or why it is not a call: too long, nested too deep, not Unicode, not JSON."""
    if len(text) > MAX_CALL_CHARS:
        return None, f"{where} is {len(text)} characters long; a call may have {MAX_CALL_CHARS}"
    depth = _depth(text)
    if depth > MAX_DEPTH:
        return None, f"{where} nests [] and {{}} {depth} deep; a call may nest {MAX_DEPTH} deep"
    try:
        value = json.loads(text)
        json.dumps(value, ensure_ascii=False).encode("utf-8")  # "\ud800" decodes to a lone surrogate: no text
    except UnicodeEncodeError:
        return None, f"{where} holds a lone surrogate (an escape such as \\ud800 alone), which is not Unicode text"
    except ValueError as err:
        return None, f"{where} is not valid JSON ({err}); write " '{"name": <function-name>, "arguments": {...}}'
    return value, None


def _depth(text: str) -> int:
    """The deepest nesting of [] and {} in `text` outside JSON strings, in one pass (no recursion)."""
    depth = deepest = 0
    in_string, escaped_at = False, -1
    for found in _STRUCTURE.finditer(text):
        at, c = found.start(), found.group()
        if at == escaped_at:  # the character after a backslash in a string
            continue
        if in_string:
            if c == "\\":
                escaped_at = at + 1
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest


def _parse_one(body: str, i: int) -> ToolCall:
    where = f"tool call {i + 1}"
    value, error = _json(body, where)
    if error is not None:
        return ToolCall(error=error)
    if not isinstance(value, dict):
        return ToolCall(error=f"{where} is a JSON {type(value).__name__}, not an object with \"name\" and \"arguments\"")
    name, arguments = value.get("name"), value.get("arguments", {})
    if not isinstance(name, str) or not name:
        return ToolCall(error=f'{where} has no "name" (a string naming the tool)')
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI's API does
        arguments, error = _json(arguments, f'{where} ({name}): "arguments", a string,')
        if error is not None:
            return ToolCall(name=name, error=error)
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
