"""The reward pool: scores in order, and a verifier that raises, hangs or dies is reported, not zeroed."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import msgpack
import pytest

import hpcrl.reward.pool as pool_module
from hpcrl.config import load_config
from hpcrl.errors import ConfigError
from hpcrl.reward.pool import RewardPool
from hpcrl.reward.types import RewardError, Sample

HERE = Path(__file__).resolve().parent


@pytest.fixture
def pool(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    with RewardPool("verifiers_for_tests:by_prompt", workers=2, timeout_s=1.5) as p:
        yield p


def sample(i: int, prompt: str, completion: str = "4", answer: str = "4") -> Sample:
    return Sample(id=f"s{i}", prompt_id=f"p{i}", prompt=prompt, completion=completion, answer=answer)


@pytest.mark.timeout(60)
def test_rewards_come_back_in_sample_order(pool):
    samples = [sample(i, "ok", completion=str(i % 3), answer="1") for i in range(9)]
    results = pool.score(samples)
    assert [r.id for r in results] == [s.id for s in samples]
    assert [r.reward for r in results] == [1.0 if i % 3 == 1 else 0.0 for i in range(9)]
    assert all(r.error is None for r in results)


@pytest.mark.timeout(60)
def test_a_raising_hanging_or_dying_verifier_is_reported_with_its_prompt_and_the_rest_are_scored(pool):
    samples = [sample(0, "ok"), sample(1, "raise"), sample(2, "hang"), sample(3, "die"),
               sample(4, "nan"), sample(5, "text"), sample(6, "ok", completion="5")]
    started = time.monotonic()
    results = {r.prompt_id: r for r in pool.score(samples)}
    assert time.monotonic() - started < 10
    assert results["p0"].reward == 1.0 and results["p6"].reward == 0.0
    assert results["p1"].reward is None and "ValueError: verifier bug" in results["p1"].error
    assert results["p2"].reward is None and "timed out after 1.5 s" in results["p2"].error
    assert results["p3"].reward is None and "died (exit code 7)" in results["p3"].error
    assert results["p4"].reward is None and "not a finite number" in results["p4"].error
    assert results["p5"].reward is None and "not a finite number" in results["p5"].error
    # The pool is whole again: the next batch is scored normally.
    assert [r.reward for r in pool.score([sample(7, "ok"), sample(8, "ok")])] == [1.0, 1.0]


@pytest.mark.timeout(60)
def test_a_workers_share_is_sent_at_once_yet_each_sample_has_the_whole_timeout_from_the_previous_answer(
        monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    sent: list[int] = []
    send = pool_module._Worker.send
    monkeypatch.setattr(pool_module._Worker, "send", lambda self, samples: (sent.append(len(samples)),
                                                                             send(self, samples)))
    with RewardPool("verifiers_for_tests:by_prompt", workers=1, timeout_s=1.5) as one:
        results = one.score([sample(i, "slow") for i in range(4)] + [sample(4, "hang"), sample(5, "ok")])
    assert sent == [6, 1]  # all at once; after the hang, what was left to the worker started in its place
    assert [r.reward for r in results] == [1.0] * 4 + [None, 1.0]  # 2.4 s of slow samples, then a hang
    assert "timed out after 1.5 s" in results[4].error
    assert all(0.5 < r.seconds < 1.5 for r in results[:4]), [r.seconds for r in results]


@pytest.mark.timeout(60)
def test_builtin_exact_match_scores_the_first_line():
    with RewardPool("hpcrl.reward.builtin:exact_match", workers=1, timeout_s=5) as p:
        results = p.score([sample(0, "1+3=", completion="4\nmore"), sample(1, "1+3=", completion="5")])
    assert [r.reward for r in results] == [1.0, 0.0]


@pytest.mark.timeout(60)
def test_a_reward_function_that_cannot_be_imported_is_an_error_at_start():
    with pytest.raises(RewardError, match="cannot import 'no_such_module_xyz'"):
        RewardPool("no_such_module_xyz:f", workers=1, timeout_s=1)


@pytest.mark.timeout(60)
def test_repeated_sample_ids_are_refused(pool):
    with pytest.raises(RewardError, match="repeated ids"):
        pool.score([sample(0, "ok"), sample(0, "ok")])


@pytest.mark.timeout(60)
def test_a_reward_function_whose_start_up_check_fails_stops_the_pool_at_start_with_its_reason(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    with pytest.raises(RewardError, match="'verifiers_for_tests:needs_what_is_missing' cannot run here: "
                                          "RuntimeError: this node lacks what the function needs"):
        RewardPool("verifiers_for_tests:needs_what_is_missing", workers=1, timeout_s=1)


@pytest.mark.timeout(60)
def test_a_numpy_scalar_is_a_score_and_a_huge_integer_is_an_error_naming_the_function_not_a_dead_worker(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    kinds = ["float32", "int64", "huge", "huger", "bool_"]
    with RewardPool("verifiers_for_tests:numbers_of_other_types", workers=1, timeout_s=5) as one:
        worker = one._workers[0]
        results = one.score([sample(i, kind) for i, kind in enumerate(kinds)])
        assert one._workers[0] is worker and worker.process.is_alive()  # never replaced: nothing killed it
    assert [r.reward for r in results] == [0.5, 1.0, None, None, None]
    assert results[2].error == ("numbers_of_other_types: returned an integer of 401 digits, too large for a float")
    assert results[3].error == ("numbers_of_other_types: returned an integer of more than 4300 digits, too large "
                                "for a float")
    assert results[4].error == ("numbers_of_other_types: returned np.True_, not a finite number (or a (number, "
                                "reason) pair)")


@pytest.mark.timeout(60)
def test_a_timeout_past_what_a_pipe_can_wait_still_scores(monkeypatch):
    """reward.timeout_s = 1e9 once raised OverflowError from poll(2) (its timeout is a C int of milliseconds)."""
    monkeypatch.syspath_prepend(str(HERE))
    with RewardPool("verifiers_for_tests:by_prompt", workers=1, timeout_s=1e9) as one:
        assert [r.reward for r in one.score([sample(0, "ok"), sample(1, "slow")])] == [1.0, 1.0]


@pytest.mark.timeout(60)
def test_a_reward_module_that_raises_at_import_stops_the_pool_with_its_exception_and_module(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    with pytest.raises(RewardError) as raised:
        RewardPool("raises_at_import:score", workers=1, timeout_s=1)
    assert str(raised.value).startswith("reward function 'raises_at_import:score': importing 'raises_at_import' "
                                        "raised KeyError: 'cpu' (raises_at_import.py:3)")


@pytest.mark.timeout(60)
def test_a_function_with_an_extra_parameter_is_given_the_rows_extra_columns(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    extra = {"accepted": ["4", "four"], "source": "gsm8k"}
    samples = [Sample(id=f"s{i}", prompt_id=f"p{i}", prompt="2+2=", completion=c, answer="", extra=extra)
               for i, c in enumerate(["four", "5"])]
    with RewardPool("verifiers_for_tests:given_extra", workers=1, timeout_s=5) as one:
        assert [r.reward for r in one.score(samples)] == [1.0, 0.0]
    with RewardPool("verifiers_for_tests:given_kwargs", workers=1, timeout_s=5) as one:
        assert [r.reward for r in one.score(samples)] == [2.0, 2.0]


@pytest.mark.timeout(60)
def test_plan_refuses_a_function_its_module_does_not_define_and_takes_one_it_does(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    config = HERE.parents[1] / "configs" / "tiny_grpo.toml"
    with pytest.raises(ConfigError) as refused:
        load_config(config, overrides=['reward.function="verifiers_for_tests:by_promt"'])
    assert refused.value.key == "reward.function"
    assert refused.value.problem == (f"module 'verifiers_for_tests' ({HERE / 'verifiers_for_tests.py'}) defines no "
                                     "function 'by_promt'")
    assert refused.value.fix.startswith("did you mean 'by_prompt'? name one it defines: ")
    assert load_config(config, overrides=['reward.function="verifiers_for_tests:by_prompt"']).reward.function == \
        "verifiers_for_tests:by_prompt"


@pytest.mark.timeout(60)
def test_a_reason_or_error_holding_a_lone_surrogate_comes_back_as_text_the_bus_can_send(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    with RewardPool("verifiers_for_tests:surrogate_reason", workers=1, timeout_s=5) as one:
        scored, failed = one.score([sample(0, "ok"), sample(1, "raise")])
    assert (scored.reward, scored.reason) == (0.0, "output: \\udc80")
    assert failed.error.startswith("surrogate_reason: ValueError: cannot read b'\\udc80' (verifiers_for_tests.py:")
    msgpack.packb([asdict(scored), asdict(failed)])  # what the reward role sends the head
