"""GPU placement checked against Slurm itself (issue 14): `hpcrl submit --check` of a GPU config's shape, scaled
down to a throw-away 6-node local cluster with 4 fake GPUs, 8 CPUs and 4 GiB per node (tools/local_slurm.sh,
HPCRL_LOCAL_SLURM_GPUS=4; profile launch/local-gpu.toml). Every task reports on the bus what it was given: the
GPUs its CUDA_VISIBLE_DEVICES shows after placement, the CPUs Slurm gave its task (SLURM_CPUS_PER_TASK) and its
OMP_NUM_THREADS; the head records them in the run's result. No CUDA is involved.

The layout: trainer 2 nodes x 4 GPUs (a rank per GPU), one inference node with 2 replicas x TP 2, a reward model
on 1 GPU. (CPU binding is not enforced here: the local cluster runs TaskPlugin=task/none on 2 real cores.)
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest
from run_helpers import head_log, wait_for
from throwaway_cluster import client_env, need_fake_gpus, run_script, throwaway_settings

from hpcrl.config import load_config
from hpcrl.launch.submit import submit_run

pytestmark = [pytest.mark.slurm]
REPO = Path(__file__).resolve().parents[2]
SCALED = ["trainer.nodes=2", "trainer.gpus_per_node=4", "trainer.global_batch_size=64", "inference.replicas=2",
          "inference.gpus_per_node=4", 'reward.kind="model"', "groups.reward.gpus_per_node=1"]


@pytest.fixture(scope="module")
def gpu_cluster():
    """The client environment of a 6-node cluster with 4 fake GPUs per node, stopped after the module."""
    need_fake_gpus()
    directory, settings = throwaway_settings("hpcrl-gpuplace-", 36817, HPCRL_LOCAL_SLURM_GPUS="4",
                                             HPCRL_LOCAL_SLURM_NODES="6")
    try:
        up = run_script(settings, "up", timeout=300)
        assert up.returncode == 0, up.stderr
        yield client_env(settings, directory)
    finally:
        run_script(settings, "down", timeout=120)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def on_gpu_cluster(gpu_cluster, monkeypatch, tmp_path):
    monkeypatch.setenv("SLURM_CONF", gpu_cluster["SLURM_CONF"])
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    yield gpu_cluster
    for job in tmp_path.glob("*/job.json"):
        subprocess.run(["scancel", "--full", job.read_text().split('"job_id": "')[1].split('"')[0]],
                       env=gpu_cluster, capture_output=True, timeout=30)


def scaled_8b(tmp_path: Path, name: str, env: dict[str, str]):
    reward_model = tmp_path / "rm"
    reward_model.mkdir(exist_ok=True)
    (reward_model / "config.json").write_text("{}")  # --check loads no model; the config only needs it there
    return load_config(REPO / "configs" / "llama8b_grpo.toml", cluster="local-gpu",
                       overrides=[f"run.run_dir={tmp_path / name}", f"cluster.slurm_conf={env['SLURM_CONF']}",
                                  f"reward.model_path={reward_model}", *SCALED])


@pytest.mark.timeout(240)
def test_every_task_sees_its_own_gpus_and_the_cpus_its_config_asks_for(on_gpu_cluster, tmp_path):
    done = submit_run(scaled_8b(tmp_path, "place", on_gpu_cluster), program="check")
    result = done.job.result()
    assert result["state"] == "COMPLETED", result
    tasks = defaultdict(list)
    for task in result["tasks"]:
        tasks[task["group"]].append(task)
    trainer, inference, (reward,) = tasks["trainer"], tasks["inference"], tasks["reward"]
    assert len(trainer) == 8 and len(inference) == 2
    by_node = defaultdict(list)
    for rank in trainer:
        assert len(rank["gpus"].split(",")) == 1, rank  # exactly one GPU
        by_node[rank["node"]].append(rank["gpus"])
        assert (rank["cpus"], rank["threads"]) == (2, 2), rank  # cluster: 8 CPUs / 4 GPUs
    assert len(by_node) == 2 and all(sorted(gpus) == ["0", "1", "2", "3"] for gpus in by_node.values()), by_node
    first, second = (set(replica["gpus"].split(",")) for replica in inference)
    assert inference[0]["node"] == inference[1]["node"] not in by_node
    assert len(first) == len(second) == 2 and not first & second, inference  # disjoint pairs
    assert all((replica["cpus"], replica["threads"]) == (4, 4) for replica in inference), inference
    assert len(reward["gpus"].split(",")) == 1 and (reward["cpus"], reward["threads"]) == (2, 2), reward
    assert reward["node"] not in by_node and reward["node"] != inference[0]["node"]


REGISTERED = re.compile(r"registered: inference rank 1 replica 1 on node (\S+) \(pid (\d+), (\d+) CPUs, GPUs (\S+)\)")


@pytest.mark.timeout(240)
def test_a_killed_replica_starts_again_on_its_node_with_the_same_gpus(on_gpu_cluster, tmp_path):
    done = submit_run(scaled_8b(tmp_path, "kill", on_gpu_cluster), program="check", hold_s=30)
    wait_for(lambda: REGISTERED.search(head_log(done.run_dir)), "inference rank 1 registering", 150)
    node, pid, cpus, gpus = REGISTERED.search(head_log(done.run_dir)).groups()
    os.kill(int(pid), signal.SIGKILL)  # the nodes are network namespaces of this host: its pids are ours
    wait_for(lambda: len(REGISTERED.findall(head_log(done.run_dir))) == 2, "inference rank 1 registering again", 90)
    assert "group inference rank 1 lost (it exited with code 137" in head_log(done.run_dir)
    result = done.job.result()
    assert result["state"] == "COMPLETED", result
    (again,) = [t for t in result["tasks"] if (t["group"], t["rank"]) == ("inference", 1)]
    assert again["pid"] != int(pid)
    assert (again["node"], again["gpus"], again["cpus"]) == (node, gpus, int(cpus))
