"""Environments that misbehave on purpose, for tests of the environment pool.

Misbehave: its step does what the policy's last turn says (the row's "answer" is returned otherwise):
    "ok"       a user message "ok N" (N: messages so far), not done
    "done"     reward 1.0, done
    "raise"    raises ValueError
    "hang"     sleeps for an hour
    "exit"     os._exit(7)
    "segv"     a segmentation fault (reads address 0 through ctypes)
    "kill"     SIGKILLs its own process
    "notlist" / "norole" / "assistant" / "nan" / "done?" / "set" / "huge" / "surrogate"   malformed returns
(a reset whose prompt is "reset raises", "reset empty" or "reset ends assistant" misbehaves too)
SlowReset's reset takes 0.5 s and its step echoes the conversation's length: a step on a worker that
does not hold the episode is 0.5 s slower, with the same reply.
"""

import ctypes
import os
import signal
import time

from hpcrl.env.base import StepResult


class Misbehave:
    def reset(self, row):
        if row["prompt"] == "reset raises":
            raise RuntimeError("no episode today")
        if row["prompt"] == "reset empty":
            return []
        if row["prompt"] == "reset ends assistant":
            return [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages):
        what = messages[-1]["content"]
        if what == "ok":
            return [{"role": "user", "content": f"ok {len(messages)}"}], None, False
        if what == "done":
            return StepResult(reward=1.0, done=True)
        if what == "raise":
            raise ValueError("environment bug")
        if what == "hang":
            time.sleep(3600)
        if what == "exit":
            os._exit(7)
        if what == "segv":
            ctypes.string_at(0)
        if what == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if what == "notlist":
            return "no, it is 7", None, False
        if what == "norole":
            return [{"content": "hi"}], None, False
        if what == "assistant":
            return [{"role": "assistant", "content": "I answer for the policy"}], None, False
        if what == "nan":
            return [], float("nan"), True
        if what == "done?":
            return [], 1.0, "yes"
        if what == "huge":
            return [{"role": "user", "content": "x" * (2 << 20)}], None, False
        if what == "surrogate":  # as text read with errors="surrogateescape" holds
            return [{"role": "user", "content": "bad byte: \udc80"}], None, False
        if what == "set":
            return [{"role": "user", "content": "x", "tool_calls": {1, 2}}], None, False
        return StepResult(messages=[{"role": "user", "content": "?"}])


class SlowReset:
    def reset(self, row):
        time.sleep(0.5)
        self.prompt = row["prompt"]
        return [{"role": "user", "content": self.prompt}]

    def step(self, messages):
        return StepResult(messages=[{"role": "user", "content": f"{self.prompt} {len(messages)}"}],
                          done=messages[-1]["content"] == "stop")


class NoStep:
    def reset(self, row):
        return []


def not_a_class(row):
    return []


class CannotRunHere:
    def reset(self, row):
        return []

    def step(self, messages):
        return [], None, True

    @staticmethod
    def check_at_start():
        raise RuntimeError("this node lacks what the environment needs")


class BreaksOnRestart(Misbehave):
    """Misbehave whose workers cannot start while HPCRL_TEST_ENV_BROKEN is set (a node that broke mid-run)."""

    @staticmethod
    def check_at_start():
        if os.environ.get("HPCRL_TEST_ENV_BROKEN"):
            raise RuntimeError("the node broke")
