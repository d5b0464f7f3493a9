"""Fake GPUs on the local cluster (issue 14): tools/local_slurm.sh with HPCRL_LOCAL_SLURM_GPUS=4 gives every
node 4 GPU GRES backed by device files, and Slurm hands them out per task as on a real cluster. Real srun
jobs on a throw-away 2-node cluster of its own report CUDA_VISIBLE_DEVICES; no CUDA is involved.

Needs root (mknod for the device files); skipped, saying so, elsewhere.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
from throwaway_cluster import client_env, need_fake_gpus, run_script, throwaway_settings

pytestmark = [pytest.mark.slurm]

GPUS = 4
REPORT = 'echo "task=$SLURM_PROCID node=$SLURMD_NODENAME gpus=$CUDA_VISIBLE_DEVICES"'


@pytest.fixture(scope="module")
def gpu_cluster():
    """(script runner, client environment, cluster directory) of a 2-node cluster with 4 fake GPUs per node."""
    need_fake_gpus()
    directory, settings = throwaway_settings("hpcrl-gpu-", 56817, **{"HPCRL_LOCAL_SLURM_GPUS": str(GPUS)})

    def script(command: str) -> subprocess.CompletedProcess[str]:
        return run_script(settings, command, timeout=180)

    try:
        up = script("up")
        assert up.returncode == 0, up.stderr
        yield script, client_env(settings, directory), directory
    finally:
        script("down")
        shutil.rmtree(directory, ignore_errors=True)


def _srun(env: dict[str, str], *args: str) -> list[dict[str, str]]:
    """Run srun with `args` (options, or hetjob components separated by ":"); each task reports one line."""
    done = subprocess.run(["srun", "--time=2", *args], env=env, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [dict(re.findall(r"(\w+)=(\S*)", line)) for line in done.stdout.splitlines() if line.startswith("task=")]
    return sorted(rows, key=lambda row: int(row["task"]))


def _cmd() -> list[str]:
    return ["bash", "-c", REPORT]


@pytest.mark.timeout(300)
def test_the_cluster_has_its_gpus_each_node_its_own_device_files(gpu_cluster):
    _, env, directory = gpu_cluster
    conf = (directory / "slurm.conf").read_text()
    assert "GresTypes=gpu" in conf and len(re.findall(rf"^NodeName=n\d .* Gres=gpu:{GPUS} ", conf, re.M)) == 2
    devices = {}
    for node in ("n1", "n2"):
        for index in range(GPUS):
            info = (directory / "dev" / node / f"nvidia{index}").stat()
            assert (info.st_mode & 0o170000) == 0o020000  # a character device
            devices[(node, index)] = (os.major(info.st_rdev), os.minor(info.st_rdev))
    assert {major for major, _ in devices.values()} == {195}
    assert len(set(devices.values())) == 2 * GPUS  # no two nodes share a device
    sinfo = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %G"], env=env, capture_output=True, text=True, timeout=30)
    assert sorted(sinfo.stdout.split("\n")[:2]) == [f"n1 gpu:{GPUS}", f"n2 gpu:{GPUS}"], sinfo.stdout


@pytest.mark.timeout(300)
def test_two_tasks_with_one_gpu_each_see_distinct_gpus(gpu_cluster):
    _, env, _ = gpu_cluster
    rows = _srun(env, "--nodes=1", "--ntasks=2", "--gpus-per-task=1", *_cmd())
    assert len(rows) == 2 and rows[0]["node"] == rows[1]["node"]
    assert sorted(row["gpus"] for row in rows) == ["0", "1"]


@pytest.mark.timeout(300)
def test_a_task_asking_two_gpus_sees_two(gpu_cluster):
    _, env, _ = gpu_cluster
    (row,) = _srun(env, "--nodes=1", "--ntasks=1", "--gres=gpu:2", *_cmd())
    assert row["gpus"] == "0,1"


@pytest.mark.timeout(300)
def test_each_hetjob_component_sees_its_own_gpus(gpu_cluster):
    _, env, _ = gpu_cluster
    rows = _srun(env, "--nodes=1", "--ntasks=2", "--gpus-per-task=1", *_cmd(),
                 ":", "--nodes=1", "--ntasks=1", f"--gres=gpu:{GPUS}", *_cmd())
    # No variable names a task's component in a step spanning them: tasks are numbered component by component.
    first, second = rows[:2], rows[2:]
    assert len(first) == 2 and len(second) == 1, rows
    assert first[0]["node"] == first[1]["node"] != second[0]["node"]  # components never share nodes
    assert sorted(row["gpus"] for row in first) == ["0", "1"]
    assert second[0]["gpus"] == ",".join(str(index) for index in range(GPUS))


@pytest.mark.timeout(300)
def test_down_leaves_nothing_running(gpu_cluster):
    script, _, directory = gpu_cluster
    pids = [int(path.read_text()) for path in (directory / "run").glob("*.pid")]
    assert len(pids) >= 4  # munged, slurmctld, 2 slurmd
    down = script("down")
    assert down.returncode == 0, down.stderr
    assert not list((directory / "run").glob("*.pid"))
    still = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            still.append(pid)
        except ProcessLookupError:
            pass
    assert still == []
    index = re.search(r"^# hpcrl-local-slurm netns (\d+)$", (directory / "slurm.conf").read_text(), re.M)
    if index:
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
        assert not re.search(rf"^hpcrl{index.group(1)}n\d+\b", names, re.M), names
