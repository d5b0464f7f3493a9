"""Evaluation's arithmetic and its [eval] table: the pass@k estimator by hand, the figures of one evaluation,
the config's checks, the progress line and the run's summary, and the figures in TensorBoard and W&B.
The loop's evaluations (when, with which weights, without touching training) are in test_controller.py."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from pathlib import Path

import pytest

from hpcrl.config import load_config
from hpcrl.config.schema import EvalConfig
from hpcrl.errors import ConfigError
from hpcrl.rl.evaluation import PromptOutcome, eval_metrics, pass_at_k
from hpcrl.rl.loop import progress_line, run_loop
from hpcrl.rl.metrics import eval_summary

REPO = Path(__file__).resolve().parents[2]


# -- pass@k ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, c, k, expected", [
    (8, 3, 4, 13 / 14),       # 1 - C(5, 4) / C(8, 4) = 1 - 5 / 70
    (4, 1, 2, 0.5),           # 1 - C(3, 2) / C(4, 2) = 1 - 3 / 6
    (10, 1, 1, 0.1),          # pass@1 is c / n
    (10, 7, 1, 0.7),
    (5, 0, 3, 0.0),           # none passes
    (5, 5, 3, 1.0),           # all pass
    (4, 2, 3, 1.0),           # n - c < k: every 3 of the 4 hold a passing one
    (6, 2, 2, 0.6),           # 1 - C(4, 2) / C(6, 2) = 1 - 6 / 15
    (200, 1, 100, 0.5),       # C(199, 100) / C(200, 100) = 100 / 200: exact with numbers of 60 digits
])
def test_pass_at_k_is_one_minus_the_chance_that_k_of_n_drawn_hold_no_pass(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-15)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 2, 5), (4, 2, 0)])
def test_pass_at_k_refuses_counts_that_cannot_be(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_one_evaluations_figures_by_hand():
    greedy = [PromptOutcome([1.0], [3]), PromptOutcome([0.0], [5]), PromptOutcome([None], [4])]
    sampled = [PromptOutcome([1.0, 0.0, 0.0, 1.0], [1, 1, 1, 1]),   # c = 2: pass@2 = 1 - 1/6
               PromptOutcome([0.0, 0.9, 0.0, 0.0], [1, 1, 1, 1]),   # 0.9 < the threshold: c = 0
               PromptOutcome([1.0, None, 1.0, 1.0], [1, 1, 1, 1])]  # an error: left out, not a zero
    assert eval_metrics(greedy=greedy, sampled=sampled, k=2, threshold=1.0) == pytest.approx({
        "eval/pass@1": 0.5, "eval/reward_mean": 0.5, "eval/length_mean": 4.0, "eval/prompts": 2,
        "eval/reward_errors": 2, "eval/sampled_pass@1": 0.25, "eval/pass@2": (5 / 6 + 0) / 2})
    # Without greedy, pass@1 and the means are the samples'; a lower threshold counts the 0.9.
    alone = eval_metrics(greedy=None, sampled=sampled, k=4, threshold=0.5)
    assert alone == pytest.approx({"eval/pass@1": (0.5 + 0.25) / 2, "eval/reward_mean": 5.9 / 11,
                                   "eval/length_mean": 1.0, "eval/prompts": 2, "eval/reward_errors": 1,
                                   "eval/pass@4": 1.0})
    every_one_failed = eval_metrics(greedy=[PromptOutcome([None], [1])], sampled=None, k=0, threshold=1.0)
    assert every_one_failed["eval/pass@1"] is None and every_one_failed["eval/reward_errors"] == 1


# -- [eval] ------------------------------------------------------------------------------------------
def test_eval_keys_are_checked_and_eval_without_held_out_prompts_is_refused_naming_the_fix():
    assert EvalConfig(n=8).pass_k == 8 and EvalConfig(n=8, k=4).pass_k == 4 and EvalConfig().interval == 0
    with pytest.raises(ConfigError, match="k: is 9, above n = 8"):
        EvalConfig(n=8, k=9)
    with pytest.raises(ConfigError, match="greedy = false: evaluation would generate nothing"):
        EvalConfig(greedy=False)
    with pytest.raises(ConfigError, match="temperature: must be above 0"):
        EvalConfig(n=4, temperature=0.0)
    tiny = REPO / "configs" / "tiny_grpo.toml"
    with pytest.raises(ConfigError, match=r'eval.interval: is 10 but the run has no evaluation prompts.*'
                                          r'data.eval_source = "builtin:echo"'):
        load_config(tiny, overrides=["eval.interval=10", 'data.eval_source=""'])
    config = load_config(tiny, overrides=["eval.interval=10", "data.eval_source=builtin:echo", "eval.n=4",
                                          "eval.at_start=true"])
    assert (config.eval.interval, config.eval.greedy, config.eval.pass_k, config.eval.at_start) == (10, True, 4, True)


def test_evaluation_may_be_turned_on_or_changed_for_a_run_that_has_checkpoints():
    """It changes no training step, so a run continues its checkpoints with it (the held-out fraction of a
    file, which takes prompts from training, is still a change of the run)."""
    from hpcrl.launch.submit import config_changes

    tiny = REPO / "configs" / "tiny_grpo.toml"
    old = load_config(tiny)
    evaluated = load_config(tiny, overrides=["eval.interval=10", "eval.n=8", "data.eval_source=builtin:echo",
                                             "data.eval_size=16", "data.eval_split=test"])
    assert config_changes(old, evaluated) == []
    assert [key for key, _, _ in config_changes(old, load_config(tiny, overrides=["data.split=other"]))] == \
        ["data.split"]


# -- what the user sees ------------------------------------------------------------------------------
def test_an_evaluated_step_shows_its_pass_at_1_in_the_progress_line_and_the_run_ends_with_the_rise():
    rows = [{"step": 0, "weight_version": 0, "eval/pass@1": 0.0625, "eval/pass@4": 0.2, "eval/reward_mean": 0.0625,
             "eval/length_mean": 1.0, "eval/prompts": 16, "eval/time_s": 0.4}]
    rows += [{"step": s, "reward_mean": 0.5, "loss": 0.1, "time_generate_s": 0.01, "time_train_s": 0.02,
              "time_weight_sync_s": 0.003} for s in range(1, 21)]
    rows[10].update({"eval/pass@1": 0.5, "eval/pass@4": 0.9, "eval/reward_mean": 0.5, "eval/length_mean": 1.0,
                     "eval/prompts": 16, "eval/time_s": 0.3})
    rows[20].update({"eval/pass@1": 0.9375, "eval/pass@4": 1.0, "eval/reward_mean": 0.9375,
                     "eval/length_mean": 1.0, "eval/prompts": 16, "eval/time_s": 0.3})
    assert progress_line(rows[0], 20) == "step    0/20  initial weights  eval pass@1 0.062 (0.40s)"
    assert progress_line(rows[10], 20).endswith("sync 0.00s  eval pass@1 0.500 (0.30s)")
    assert "eval" not in progress_line(rows[9], 20)
    assert eval_summary(rows).splitlines() == [
        "eval pass@1 (16 prompts): 0.062 at step 0 -> 0.938 at step 20, best 0.938 at step 20",
        "  step     0  pass@1 0.062  pass@4 0.200  reward 0.062  length 1.0  0.4 s",
        "  step    10  pass@1 0.500  pass@4 0.900  reward 0.500  length 1.0  0.3 s",
        "  step    20  pass@1 0.938  pass@4 1.000  reward 0.938  length 1.0  0.3 s"]
    assert eval_summary(rows[1:10]) is None


def test_the_evaluations_reach_tensorboard_at_their_steps(tmp_path: Path):
    """A fake run (test_controller.py's in-memory groups) evaluating at steps 0, 2 and 3. W&B gets the same
    scalars from MetricsLog.write (test_metrics.py); a run like this one logged eval/pass@1 at W&B steps 0, 2, 3."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sys.path.insert(0, str(Path(__file__).parent))
    from fake_config import fake_config
    from fake_ports import FakePorts

    config = fake_config(tmp_path, run_name="evaluated", seed=1, steps=3, prompts_per_step=2, group_size=2,
                         max_policy_lag=1)
    config = dataclasses.replace(config, eval=EvalConfig(interval=2, n=2, k=2),
                                 data=dataclasses.replace(config.data, eval_source="builtin:echo", eval_size=4))
    asyncio.run(asyncio.wait_for(run_loop(config, FakePorts()), 30))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("eval/pass@1")] == [0, 2, 3]
    assert [e.step for e in events.Scalars("eval/pass@2")] == [0, 2, 3]
    assert [e.step for e in events.Scalars("reward_mean")] == [1, 2, 3]
