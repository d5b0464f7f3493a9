"""Start and rejoin timeouts: derived from the model's size unless [run] sets them, and used."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcrl.config.load import load_config_and_shape
from hpcrl.errors import ConfigError
from hpcrl.launch.submit import launch_record
from hpcrl.plan.timeouts import Timeouts, run_timeouts
from hpcrl.roles.trainer import rendezvous_timeout
from hpcrl.slurm.spec import job_spec

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def timeouts_of(name: str, *overrides: str) -> Timeouts:
    config, shape = load_config_and_shape(REPO / "configs" / name, cluster="generic", overrides=overrides)
    return run_timeouts(config, shape)


@pytest.mark.parametrize("name, start_s, rejoin_s", [
    # 600 s + 10 s/GB and 300 s + 5 s/GB of weights in model.dtype:
    ("tiny_grpo.toml", 600, 300),        # 328,320 parameters in fp32: 0.0013 GB
    ("llama8b_grpo.toml", 761, 380),     # 8.03e9 x 2 B = 16.06 GB: 600 + 160.6, 300 + 80.3
    ("llama70b_grpo.toml", 2011, 1006),  # 70.55e9 x 2 B = 141.1 GB: 600 + 1411.1, 300 + 705.5
])
def test_unset_timeouts_grow_with_the_bytes_of_the_model_weights(name: str, start_s: float, rejoin_s: float):
    assert timeouts_of(name) == Timeouts(start_s=start_s, rejoin_s=rejoin_s)


def test_a_timeout_set_in_run_wins_over_the_derived_one():
    assert timeouts_of("llama70b_grpo.toml", "run.start_timeout_s=3600") == Timeouts(start_s=3600, rejoin_s=1006)
    assert timeouts_of("llama70b_grpo.toml", "run.rejoin_timeout_s=45") == Timeouts(start_s=2011, rejoin_s=45)


@pytest.mark.parametrize("key", ["start_timeout_s", "rejoin_timeout_s"])
def test_a_negative_timeout_is_a_config_error_naming_the_key_and_the_fix(key: str):
    with pytest.raises(ConfigError, match=rf"run\.{key}: must be 0 \(derived from the model's size\) or more "
                                          rf"seconds, got -1\.0\. Fix: remove {key} to derive it") as caught:
        timeouts_of("tiny_grpo.toml", f"run.{key}=-1")
    assert caught.value.key == f"run.{key}"


def test_launch_json_and_the_trainer_rendezvous_wait_the_start_timeout():
    config, _ = load_config_and_shape(REPO / "configs" / "llama70b_grpo.toml", cluster="generic", overrides=())
    assert launch_record(config, job_spec(config), executor="slurm", python="/venv/bin/python").start_timeout_s == 2011
    assert rendezvous_timeout(config).total_seconds() == 2011
    assert launch_record(config, job_spec(config), executor="slurm", python="/venv/bin/python",
                         start_timeout_s=30).start_timeout_s == 30  # hpcrl submit's own override
