"""The built-in environments: feedback (the tiny model's multi-turn task, on the guess data task) and
python_tool (a Python tool whose calls run in code_tests' sandbox), through the pool's worker processes."""

from __future__ import annotations

import importlib.util

import pytest

from hpcrl.config.builtin_names import BUILTIN_ENVIRONMENTS
from hpcrl.config.schema import EnvConfig
from hpcrl.data.builtin import guess
from hpcrl.env.base import ENVIRONMENTS, StepResult, resolve
from hpcrl.env.builtin import PythonTool
from hpcrl.env.pool import EnvPool
from hpcrl.env.types import EnvRequest

pytestmark = pytest.mark.timeout(60)


def assistant(content: str) -> dict:
    return {"role": "assistant", "content": content}


def play(pool: EnvPool, rows: list[dict], turns: list[list[str]]) -> list[list]:
    """Each row's episode through the pool, the policy answering its turns in order until done; the replies."""
    episodes = [EnvRequest(episode=f"{row['id']}/0", row=row) for row in rows]
    conversations = {r.episode: list(reply.messages) for r, reply in zip(episodes, pool.reset(episodes))}
    replies: list[list] = [[] for _ in rows]
    for turn in range(max(len(t) for t in turns)):
        live = [(i, r) for i, r in enumerate(episodes) if turn < len(turns[i]) and not (replies[i] and replies[i][-1].done)]
        for i, r in live:
            conversations[r.episode].append(assistant(turns[i][turn]))
        answers = pool.step([EnvRequest(episode=r.episode, row=r.row, messages=conversations[r.episode])
                             for _, r in live])
        for (i, r), reply in zip(live, answers):
            replies[i].append(reply)
            conversations[r.episode].extend(reply.messages)
    return replies


def test_the_guess_task_hides_a_digit_behind_the_same_prompt_in_each_split():
    rows = [guess("train", i) for i in range(50)]
    assert rows[3] == {"id": "guess-train-3", "prompt": "guess:", "answer": rows[3]["answer"]}
    assert {r["answer"] for r in rows} == set("0123456789")
    assert [guess("train", i) for i in range(50)] == rows
    assert [r["answer"] for r in rows] != [guess("test", i)["answer"] for i in range(50)]


def test_feedback_scores_a_right_guess_at_the_first_or_second_try_and_tells_the_digit_after_a_wrong_one():
    rows = [{"id": f"g{i}", "prompt": "guess:", "answer": "7"} for i in range(4)]
    with EnvPool(EnvConfig(environment="feedback", workers=2)) as pool:
        assert pool.reset([EnvRequest(episode="g0/0", row=rows[0])])[0].messages == [{"role": "user",
                                                                                       "content": "guess:"}]
        replies = play(pool, rows, [[" 7 "], ["3", "7"], ["3", "5"], ["3", "7", "7"]])
    told = [{"role": "user", "content": "no, it is 7"}]
    assert [[(r.messages, r.reward, r.done) for r in episode] for episode in replies] == [
        [([], 1.0, True)],
        [(told, None, False), ([], 1.0, True)],
        [(told, None, False), ([], 0.0, True)],
        [(told, None, False), ([], 1.0, True)],  # done at the second try: no third turn
    ]


def test_every_character_feedback_writes_is_in_the_tiny_models_alphabet(repo):
    spec = importlib.util.spec_from_file_location("make_tiny_model", repo / "tools" / "make_tiny_model.py")
    assert spec and spec.loader
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    texts = []
    for digit in "0123456789":
        env = resolve("feedback")()
        first = env.reset({"id": "g", "prompt": "guess:", "answer": digit})
        texts += [m["content"] for m in first + env.step([*first, assistant("x")]).messages]
    assert len(texts) == 20 and set("".join(texts)) <= set(tiny.ALPHABET), texts


def test_python_tool_runs_each_call_in_the_sandbox_returns_its_output_and_ends_at_a_turn_without_a_call():
    row = {"id": "m1", "prompt": "What is 2**100 mod 7?", "answer": "2"}
    code = '<tool_call>\n{"name": "python", "arguments": {"code": "print(pow(2, 100, 7))"}}\n</tool_call>'
    turns = [[f"Let me compute.\n{code}", "\\boxed{2}"],
             ['<tool_call>{"name": "python", "arguments": {"code": "1/0"}}</tool_call>'
              '<tool_call>{"name": "shell", "arguments": {}}</tool_call><tool_call>{"name": "python", "arguments": }'
              f"</tool_call>{code}"]]
    with EnvPool(EnvConfig(environment="python_tool", workers=1, step_timeout_s=30)) as pool:
        first = pool.reset([EnvRequest(episode="m1/0", row=row)])[0].messages
        replies = play(pool, [row, {**row, "id": "m2"}], turns)
    assert [m["role"] for m in first] == ["system", "user"] and first[1]["content"] == row["prompt"]
    assert '"name": "python"' in first[0]["content"] and "<tool_call>" in first[0]["content"]
    assert [(r.messages, r.reward, r.done) for r in replies[0]] == [
        ([{"role": "tool", "content": "2\n", "name": "python"}], None, False), ([], None, True)]
    errors = replies[1][0].messages
    assert errors[0]["content"].endswith("ZeroDivisionError: division by zero\n")
    assert "_sandbox_boot" not in errors[0]["content"]
    assert errors[1:] == [{"role": "tool", "content": "error: no tool 'shell'; the one tool is python", "name": "shell"},
                          {"role": "tool", "content": "error: tool call 3 is not valid JSON (Expecting value: line 1 "
                                                      'column 33 (char 32)); write {"name": <function-name>, '
                                                      '"arguments": {...}}'},
                          {"role": "tool", "content": "not run: at most 2 tool calls a turn", "name": "python"}]


def test_every_registered_environment_resolves_to_a_class_with_reset_and_step_and_config_knows_its_name():
    assert tuple(ENVIRONMENTS) == BUILTIN_ENVIRONMENTS
    for name in ENVIRONMENTS:
        assert callable(resolve(name)().reset)


def test_python_tool_lists_its_tool_before_the_rows_own_conversation_and_keeps_the_rows_system_prompt():
    env = resolve("python_tool")()
    plain = env.reset({"id": "a", "prompt": "1+1?", "answer": "2"})
    assert plain[0]["content"].startswith(env.PREAMBLE + "\n\n# Tools\n") and plain[1:] == [{"role": "user",
                                                                                              "content": "1+1?"}]
    chat = env.reset({"id": "a", "prompt": "Be terse.\n1+1?", "answer": "2",
                      "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "1+1?"}]})
    assert chat[0]["content"].startswith("Be terse.\n\n# Tools\n") and chat[1:] == [{"role": "user",
                                                                                     "content": "1+1?"}]


def test_python_tool_answers_a_call_nested_too_deep_with_a_tool_message_not_an_environment_error():
    """Run in this process: no sandbox starts, since a malformed call runs nothing."""
    row = {"id": "m1", "prompt": "What is 2**100 mod 7?", "answer": "2"}
    tool = PythonTool()
    deep = '<tool_call>{"name": "python", "arguments": {"code": ' + "[" * 3000 + "]" * 3000 + "}}</tool_call>"
    result = tool.step([*tool.reset(row), assistant(deep)])
    assert result == StepResult(messages=[{"role": "tool", "content": "error: tool call 1 nests [] and {} 3002 deep; "
                                                                      "a call may nest 64 deep"}])
