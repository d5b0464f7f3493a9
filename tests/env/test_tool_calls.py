"""Tool calls read from a policy turn in the Hermes format of Qwen's chat templates; a malformed call is a
ToolCall with the reason, for the model to read, never an exception."""

from __future__ import annotations

import json

import pytest

from hpcrl.env.tools import (
    MAX_CALL_CHARS,
    MAX_DEPTH,
    ToolCall,
    parse_tool_calls,
    tool_message,
    tool_schema,
    tools_system_prompt,
)

CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>'


@pytest.mark.parametrize("text, calls", [
    ("The answer is \\boxed{3}.", []),
    (CALL, [ToolCall("python", {"code": "print(1)"})]),
    ("first\n" + CALL + "\nthen\n" + CALL.replace("print(1)", "x = 2"),
     [ToolCall("python", {"code": "print(1)"}), ToolCall("python", {"code": "x = 2"})]),
    ('<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"cats\\"}"}</tool_call>',  # arguments as a JSON string
     [ToolCall("search", {"q": "cats"})]),
    ('<tool_call>{"name": "now"}</tool_call>', [ToolCall("now", {})]),
    ('<tool_call>{"name": "python", "arguments": {"code": "print(1)"}</tool_call>',
     [ToolCall(error="tool call 1 is not valid JSON (Expecting ',' delimiter: line 1 column 53 (char 52)); write "
                     '{"name": <function-name>, "arguments": {...}}')]),
    ('<tool_call>["python"]</tool_call>', [ToolCall(error='tool call 1 is a JSON list, not an object with "name" and '
                                                          '"arguments"')]),
    ('<tool_call>{"arguments": {}}</tool_call>', [ToolCall(error='tool call 1 has no "name" (a string naming the tool)')]),
    ('<tool_call>{"name": "python", "arguments": [1]}</tool_call>',
     [ToolCall("python", error='tool call 1 (python): "arguments" is not a JSON object')]),
    (CALL + '\n<tool_call>\n{"name": "python", "argu', [ToolCall("python", {"code": "print(1)"}),
                                                        ToolCall(error="tool call 2 has no closing </tool_call>")]),
])
def test_tool_calls_are_read_in_order_and_a_malformed_one_says_what_is_wrong(text, calls):
    assert parse_tool_calls(text) == calls


def test_a_written_call_reads_back_and_the_tool_answers_in_a_tool_message():
    text = '<tool_call>\n{"name": "python", "arguments": {"code": "print(\'é\')"}}\n</tool_call>'  # as Hermes writes it
    assert parse_tool_calls(text) == [ToolCall("python", {"code": "print('é')"})]
    assert tool_message("é\n", name="python") == {"role": "tool", "content": "é\n", "name": "python"}
    assert tool_message("x") == {"role": "tool", "content": "x"}


def test_the_system_prompt_lists_the_tools_as_qwens_templates_do():
    tool = tool_schema("python", "Run code", {"type": "object", "properties": {}})
    assert tools_system_prompt([tool], "Be brief.") == (
        "Be brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "python", "description": "Run code", "parameters": '
        '{"type": "object", "properties": {}}}}\n</tools>\n\n'
        "For each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call>")


LONG = '{"name": "python", "arguments": {"code": "' + "x" * MAX_CALL_CHARS + '"}}'


@pytest.mark.timeout(30)
@pytest.mark.parametrize("body, error", [
    ("[" * 5000 + "]" * 5000, f"tool call 1 nests [] and {{}} 5000 deep; a call may nest {MAX_DEPTH} deep"),
    ('{"name": "python", "arguments": "' + "[" * 5000 + '"}',  # arguments as a JSON string, nested
     f'tool call 1 (python): "arguments", a string, nests [] and {{}} 5000 deep; a call may nest {MAX_DEPTH} deep'),
    (LONG, f"tool call 1 is {len(LONG)} characters long; a call may have {MAX_CALL_CHARS}"),
    ('{"name": "python", "arguments": {"code": "print(\\"\\ud800\\")"}}',
     "tool call 1 holds a lone surrogate (an escape such as \\ud800 alone), which is not Unicode text"),
])
def test_a_call_too_deep_too_long_or_not_unicode_says_so_instead_of_raising(body, error):
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert call.error == error


def test_brackets_inside_strings_do_not_count_toward_the_depth():
    code = "print('" + "[" * 100 + '\\"{' * 100 + "')"  # in JSON: brackets, escaped backslashes and quotes
    (call,) = parse_tool_calls('<tool_call>{"name": "python", "arguments": {"code": ' + json.dumps(code) + "}}</tool_call>")
    assert call == ToolCall("python", {"code": code})
