"""The environment pool: episodes served in worker processes; an environment that raises, hangs, dies or
returns something malformed gives an error reply naming the episode, its worker is replaced, and the rest
of the batch is answered."""

from __future__ import annotations

import time
import zlib
from pathlib import Path

import pytest

from hpcrl.config import load_config
from hpcrl.config.schema import EnvConfig
from hpcrl.env.pool import EnvPool
from hpcrl.env.types import EnvError, EnvRequest
from hpcrl.errors import ConfigError

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _envs_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))


def pool(environment: str = "envs_for_tests:Misbehave", *, workers: int = 2, timeout_s: float = 10.0,
         **extra) -> EnvPool:
    return EnvPool(EnvConfig(environment=environment, workers=workers, step_timeout_s=timeout_s), **extra)


def request(episode: str, turn: str | None = None, prompt: str = "go") -> EnvRequest:
    """A reset of `episode` (turn None), else a step whose policy turn says `turn`."""
    row = {"id": episode.partition("/")[0], "prompt": prompt, "answer": "7"}
    if turn is None:
        return EnvRequest(episode=episode, row=row)
    return EnvRequest(episode=episode, row=row, messages=[{"role": "user", "content": prompt},
                                                          {"role": "assistant", "content": turn}])


def on_worker(index: int, workers: int, count: int, prefix: str = "e") -> list[str]:
    """`count` episode ids that the pool routes to worker `index` of `workers`."""
    found, i = [], 0
    while len(found) < count:
        if zlib.crc32(f"{prefix}{i}/0".encode()) % workers == index:
            found.append(f"{prefix}{i}/0")
        i += 1
    return found


def test_an_episodes_first_messages_and_steps_come_back_in_request_order():
    with pool() as p:
        episodes = [f"p{i}/{k}" for i in range(4) for k in range(2)]
        first = p.reset([request(e) for e in episodes])
        assert [r.episode for r in first] == episodes
        assert all(r.messages == [{"role": "user", "content": "go"}] and r.error is None for r in first)
        after = p.step([request(e, "ok" if i % 2 else "done") for i, e in enumerate(episodes)])
    assert [(r.episode, r.messages, r.reward, r.done) for r in after] == [
        (e, [{"role": "user", "content": "ok 2"}], None, False) if i % 2 else (e, [], 1.0, True)
        for i, e in enumerate(episodes)]


def test_a_hanging_environment_is_cut_at_its_timeout_its_worker_replaced_and_the_rest_of_its_share_answered():
    with pool(workers=1, timeout_s=1.0) as p:
        started = time.monotonic()
        replies = p.step([request("a/0", "ok"), request("b/0", "hang"), request("c/0", "ok"), request("d/0", "done")])
        took = time.monotonic() - started
        assert p.restarts == 1
        assert [r.error for r in replies[:1] + replies[2:]] == [None, None, None]
        assert [r.messages for r in replies[2:]] == [[{"role": "user", "content": "ok 2"}], []]
        assert replies[1].messages is None and not replies[1].done
        assert replies[1].error == ("environment 'envs_for_tests:Misbehave', episode b/0: timed out after 1 s "
                                    "(env.step_timeout_s)")
        assert 1.0 <= replies[1].seconds < 3 and took < 5, (replies[1].seconds, took)
        assert p.step([request("e/0", "done")])[0].reward == 1.0  # whole again


@pytest.mark.parametrize("how, why", [("exit", "died (exit code 7)"), ("segv", "died (exit code -11)"),
                                      ("kill", "died (exit code -9)")])
def test_an_environment_that_takes_its_worker_down_is_an_error_the_worker_is_replaced_and_others_are_answered(
        how, why):
    with pool() as p:
        episodes = on_worker(0, 2, 4) + on_worker(1, 2, 2)
        turns = ["ok", how, "ok", "done", "ok", "ok"]  # the crash in worker 0's share, before two of its calls
        replies = p.step([request(e, t) for e, t in zip(episodes, turns)])
        assert p.restarts == 1
    assert replies[1].error == f"environment 'envs_for_tests:Misbehave', episode {episodes[1]}: its worker process {why}"
    assert [r.error for i, r in enumerate(replies) if i != 1] == [None] * 5
    assert [r.messages for r in replies] == [[{"role": "user", "content": "ok 2"}], None,
                                             [{"role": "user", "content": "ok 2"}], [],
                                             [{"role": "user", "content": "ok 2"}], [{"role": "user", "content": "ok 2"}]]


def test_an_environment_that_raises_is_an_error_naming_the_episode_and_the_line_and_the_worker_goes_on():
    with pool(workers=1) as p:
        replies = p.step([request("a/0", "raise"), request("b/0", "done")])
        assert p.restarts == 0
    assert replies[0].error.startswith("environment 'envs_for_tests:Misbehave', episode a/0: step raised "
                                       "ValueError: environment bug (envs_for_tests.py:")
    assert replies[1].reward == 1.0


def test_malformed_returns_are_errors_saying_what_was_wrong():
    with pool(workers=1) as p:
        turns = ["notlist", "norole", "assistant", "nan", "done?", "set", "huge"]
        steps = p.step([request(f"s{i}/0", t) for i, t in enumerate(turns)])
        resets = p.reset([request("r0/0", prompt="reset raises"), request("r1/0", prompt="reset empty")])
        assert p.restarts == 0
    errors = [r.error.partition(": ")[2] for r in steps + resets]
    assert errors[0] == "step returned str 'no, it is 7', not a list of messages ({\"role\": ..., \"content\": ...} dicts)"
    assert errors[1] == ("step: message 0 has role None; an environment's messages here have the roles system, "
                         "user, tool")
    assert errors[2].startswith("step: message 0 has role 'assistant'")
    assert errors[3] == "step returned reward nan, not a finite number"
    assert errors[4] == "step returned done = 'yes', not True or False"
    assert errors[5].startswith("step returned messages that are not plain JSON data: Object of type set")
    assert errors[6].startswith("step returned 2097230 bytes of messages; a reply may hold 1 MiB")
    assert errors[7].startswith("reset raised RuntimeError: no episode today (envs_for_tests.py:")
    assert errors[8] == "reset returned no messages: the policy needs a conversation to answer"
    assert all(r.messages is None and r.reward is None and not r.done for r in steps + resets)


def test_a_step_on_a_worker_that_never_saw_the_episode_rebuilds_it_by_reset_and_answers_the_same():
    """SlowReset's reset takes 0.5 s: a step on the worker holding the episode is quick, one elsewhere
    (another reward task's pool, a replaced worker) rebuilds it first, and both reply the same."""
    with pool("envs_for_tests:SlowReset", workers=1) as holder, \
            pool("envs_for_tests:SlowReset", workers=1) as stranger:
        holder.reset([request("a/0")])
        held = holder.step([request("a/0", "next")])[0]
        rebuilt = stranger.step([request("a/0", "next")])[0]
        assert held.messages == rebuilt.messages == [{"role": "user", "content": "go 2"}]
        assert held.seconds < 0.4 <= rebuilt.seconds, (held.seconds, rebuilt.seconds)
        # done drops the instance: the next step rebuilds it
        assert holder.step([request("a/0", "stop")])[0].done
        assert holder.step([request("a/0", "next")])[0].seconds >= 0.4


def test_a_worker_holds_at_most_held_per_worker_episodes_and_rebuilds_one_it_let_go():
    with pool("envs_for_tests:SlowReset", workers=1, held_per_worker=1) as p:
        p.reset([request("a/0"), request("b/0")])
        assert p.step([request("b/0", "next")])[0].seconds < 0.4
        assert p.step([request("a/0", "next")])[0].seconds >= 0.4


def test_a_hanging_call_holds_up_only_its_own_worker():
    slow, quick = on_worker(0, 2, 1)[0], on_worker(1, 2, 1)[0]
    with pool(workers=2, timeout_s=2.0) as p:
        hanging = p.submit("step", [request(slow, "hang")])[0]
        started = time.monotonic()
        assert p.step([request(quick, "done")])[0].reward == 1.0
        assert time.monotonic() - started < 1.5 and not hanging.done()
        assert "timed out after 2 s" in hanging.result(timeout=10).error


def test_calls_the_interface_does_not_allow_are_refused_before_anything_runs():
    with pool(workers=1) as p:
        with pytest.raises(EnvError, match="more than once"):
            p.reset([request("a/0"), request("a/0")])
        with pytest.raises(EnvError, match="a reset carries no messages and a step the conversation"):
            p.step([request("a/0")])
    with pytest.raises(EnvError, match="pool is closed"):
        p.reset([request("a/0")])


@pytest.mark.parametrize("environment, error", [
    ("no_such_module_xyz:Env", "cannot import 'no_such_module_xyz'"),
    ("envs_for_tests:Missing", "envs_for_tests has no 'Missing'"),
    ("envs_for_tests:not_a_class", "is a function, not a class"),
    ("envs_for_tests:NoStep", "class envs_for_tests.NoStep has no step method"),
    ("envs_for_tests:CannotRunHere", "cannot run here: RuntimeError: this node lacks what the environment needs"),
    ("feedbak", "neither a built-in environment nor \"module:Class\": did you mean 'feedback'?"),
])
def test_an_environment_that_cannot_be_used_stops_the_pool_at_start(environment, error):
    with pytest.raises(EnvError) as raised:
        pool(environment, workers=1)
    assert error in str(raised.value)


def test_a_worker_that_cannot_be_replaced_fails_its_calls_with_the_reason_until_one_starts_again(monkeypatch):
    with pool("envs_for_tests:BreaksOnRestart", workers=1) as p:
        monkeypatch.setenv("HPCRL_TEST_ENV_BROKEN", "1")
        died, after = p.step([request("a/0", "exit"), request("b/0", "done")])
        assert "its worker process died (exit code 7)" in died.error
        assert after.error.endswith("episode b/0: its worker was lost and none could be started in its place: "
                                    "environment 'envs_for_tests:BreaksOnRestart' cannot run here: RuntimeError: "
                                    "the node broke")
        assert "no worker could be started in place of a lost one" in p.step([request("c/0", "done")])[0].error
        monkeypatch.delenv("HPCRL_TEST_ENV_BROKEN")
        assert p.step([request("d/0", "done")])[0].reward == 1.0
        assert p.restarts == 3


def test_replies_the_head_cannot_take_are_refused_by_the_pool_and_the_worker_goes_on():
    """A lone surrogate (msgpack on the bus and the tokenizer refuse it) and a reset ending with the assistant's
    message (the policy's turn cannot follow it) are the episode's errors, in the pool, not the head's failure."""
    with pool(workers=1) as p:
        step = p.step([request("s/0", "surrogate")])[0]
        reset = p.reset([request("r/0", prompt="reset ends assistant")])[0]
        assert p.restarts == 0 and p.step([request("d/0", "done")])[0].reward == 1.0
    assert step.error == ("environment 'envs_for_tests:Misbehave', episode s/0: step: message 0 (user) holds '\\udc80', "
                          'a lone surrogate that is not Unicode text (text decoded with errors="surrogateescape"?): '
                          "it cannot be tokenized or sent")
    assert reset.error.endswith("episode r/0: reset ended with an assistant message, but the policy answers the first "
                                "messages: end them with a user or tool message (an assistant message may come before)")
    assert step.messages is None and reset.messages is None


def test_a_step_timeout_past_what_a_pipe_can_wait_leaves_the_pool_serving():
    """A wait of 1e9 s once raised OverflowError from poll(2) in the pool's thread, and every later call failed.
    Set on the pool, whatever bound env.step_timeout_s has in the config."""
    with pool(workers=1) as p:
        p.timeout_s = 1e9
        assert p.reset([request("a/0")])[0].messages == [{"role": "user", "content": "go"}]
        assert p.step([request("a/0", "ok")])[0].messages == [{"role": "user", "content": "ok 2"}]
        assert p.step([request("b/0", "done")])[0].reward == 1.0


def test_an_environment_module_that_raises_at_import_stops_the_pool_with_its_exception_and_module():
    with pytest.raises(EnvError) as raised:
        pool("env_raises_at_import:Guess", workers=1)
    assert str(raised.value).startswith(
        "environment 'env_raises_at_import:Guess': importing 'env_raises_at_import' raised FileNotFoundError: "
        "[Errno 2] No such file or directory: '/nonexistent/hpcrl-test-words.txt' (")


@pytest.mark.parametrize("module, name, guess", [("envs_for_tests", "Misbehav", "Misbehave"),
                                                 ("env_raises_at_import", "Guesser", "Guess")])
def test_plan_refuses_a_class_its_module_does_not_define_without_importing_the_module(module, name, guess):
    """Read from the source: env_raises_at_import would raise if plan imported it."""
    with pytest.raises(ConfigError) as refused:
        load_config(REPO / "configs" / "tiny_env_grpo.toml", overrides=[f'env.environment="{module}:{name}"'])
    assert refused.value.key == "env.environment"
    assert refused.value.problem == f"module {module!r} ({HERE / module}.py) defines no class {name!r}"
    assert refused.value.fix.startswith(f"did you mean {guess!r}? name one it defines: ")
