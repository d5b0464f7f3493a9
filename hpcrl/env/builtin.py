"""Built-in environments (named in ENVIRONMENTS, hpcrl/env/base.py).

feedback      the toy multi-turn task of the tiny character-level model (data.source = "builtin:guess"):
              the policy guesses a hidden digit; a wrong first guess gets "no, it is D", and the second
              guess is scored. Reward 1.0 for a right guess at either try, else 0.0: a policy that
              copies the digit it was told scores 1.0 whatever its first guess.
python_tool   a math task for chat models with a Python tool (Hermes tool calls, hpcrl.env.tools): the row's
              prompt (or its "messages") after a system message listing the tool; each
              "python" call runs its code in code_tests' sandbox (hpcrl.workers.sandbox) and its output
              comes back as a tool message; a turn without a tool call is the final answer, scored by
              the run's [reward] (e.g. math_verify).

Both keep no state beyond their row: which try this is, and what was called, is read from the
conversation (the state rule of hpcrl/env/base.py).
"""

from __future__ import annotations

import re

from hpcrl.env.base import StepResult
from hpcrl.env.tools import parse_tool_calls, tool_message, tool_schema, tools_system_prompt
from hpcrl.env.types import Message
from hpcrl.workers.sandbox import Limits, check_sandbox, run_code


def _last_policy_turn(messages: list[Message]) -> str:
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("step was called without the policy's turn last in the conversation")
    return str(messages[-1]["content"])


class Feedback:
    """Guess the row's digit; after a wrong first guess the environment says it (module docstring)."""

    def reset(self, row: dict) -> list[Message]:
        self.answer = str(row["answer"]).strip()
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages: list[Message]) -> StepResult:
        guess = _last_policy_turn(messages).strip()
        tries = sum(1 for m in messages if m.get("role") == "assistant")
        if guess == self.answer:
            return StepResult(reward=1.0, done=True)
        if tries == 1:  # every character here is in the tiny tokenizer's alphabet (tools/make_tiny_model.py)
            return StepResult(messages=[{"role": "user", "content": f"no, it is {self.answer}"}])
        return StepResult(reward=0.0, done=True)


#: The sandbox's frames in a traceback (hpcrl/workers/_sandbox_boot.py running solution.py): not the model's.
_BOOT_FRAME = re.compile(r'  File "[^"]*_sandbox_boot\.py", line \d+, in \w+\n(?:    .*\n)*?(?=  File |\S)')


class PythonTool:
    """Solve the row's problem, with a Python tool whose code runs in a sandbox (module docstring)."""

    #: Each call's sandbox: the wall times of CALLS_PER_TURN calls stay under env.step_timeout_s's default (10 s).
    LIMITS = Limits(cpu_s=3.0, wall_s=4.0, memory_mib=1024, processes=16, output_kib=256)
    CALLS_PER_TURN = 2
    OUTPUT_CHARS = 2000
    TOOLS = [tool_schema("python", "Run Python 3 code and return what it prints (stdout, then stderr). Each call "
                         "starts afresh: nothing is kept between calls. No network.",
                         {"type": "object", "properties": {"code": {"type": "string",
                                                                    "description": "the Python code to run"}},
                          "required": ["code"]})]
    PREAMBLE = ("You are a careful mathematician. Use the python tool to compute when it helps; print what you "
                "need to see. When you are done, answer without a tool call and put the final answer in "
                "\\boxed{}.")

    @staticmethod
    def check_at_start() -> None:
        """The pool does not start where no sandbox can be built (hpcrl.workers.process.check_at_start)."""
        check_sandbox()

    def reset(self, row: dict) -> list[Message]:
        """The row's conversation (its "messages" if it has them, else its prompt as a user message) after a
        system message listing the tool; a system message of the row's own replaces PREAMBLE in it."""
        given = row.get("messages")
        conversation = [dict(m) for m in given] if given else [{"role": "user", "content": row["prompt"]}]
        preamble = self.PREAMBLE
        if conversation[0].get("role") == "system":
            preamble = conversation.pop(0)["content"]
        return [{"role": "system", "content": tools_system_prompt(self.TOOLS, preamble)}, *conversation]

    def step(self, messages: list[Message]) -> StepResult:
        calls = parse_tool_calls(_last_policy_turn(messages))
        if not calls:
            return StepResult(done=True)  # the final answer: the run's [reward] scores it
        replies = []
        for i, call in enumerate(calls):
            if call.error:
                replies.append(tool_message(f"error: {call.error}", name=call.name))
            elif i >= self.CALLS_PER_TURN:
                replies.append(tool_message(f"not run: at most {self.CALLS_PER_TURN} tool calls a turn", name=call.name))
            elif call.name != "python":
                replies.append(tool_message(f"error: no tool {call.name!r}; the one tool is python", name=call.name))
            elif not isinstance(call.arguments.get("code"), str):
                replies.append(tool_message('error: python takes {"code": "<the code>"}', name="python"))
            else:
                replies.append(tool_message(self.run(call.arguments["code"]), name="python"))
        return StepResult(messages=replies)

    def run(self, code: str) -> str:
        """What the model sees of its code's run: the output, and why it stopped if it did not end."""
        outcome, output = run_code(code, self.LIMITS, output_chars=self.OUTPUT_CHARS)
        output = _BOOT_FRAME.sub("", output)
        if outcome.passed:
            return output or "(no output)"
        if outcome.reason and outcome.reason not in output:
            return f"{output}\n{outcome.reason}" if output else outcome.reason
        return output
