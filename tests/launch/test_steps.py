"""The srun command lines the head starts groups with (pure)."""

from __future__ import annotations

from pathlib import Path

from hpcrl.launch.steps import srun_argv
from hpcrl.slurm.spec import GroupSlot

TRAINER = GroupSlot(name="trainer", component=1, nodes=2, tasks_per_node=4, gpus_per_node=4, cpus_per_task=8,
                    ranks_per_replica=8, module="hpcrl.roles", first_node=0)


def test_a_hetjob_group_is_one_step_on_its_own_het_group_with_one_log_per_rank():
    argv = srun_argv(TRAINER, layout="hetjob", run_dir=Path("/runs/x"), python="py")
    assert "--het-group=1" in argv and "--nodes=2" in argv and "--ntasks=8" in argv
    assert "--output=/runs/x/logs/trainer/rank%t.log" in argv  # %t: the rank within the group
    assert not any("%j" in a for a in argv)  # %j would be each component's own id
    assert argv[-5:] == ["py", "-u", "-m", "hpcrl.roles", "trainer"]


def test_a_split_group_is_one_step_on_its_node_range():
    argv = srun_argv(TRAINER, layout="split", run_dir=Path("/runs/x"), python="py", nodelist=["n2", "n3"])
    assert "--nodelist=n2,n3" in argv and not any(a.startswith("--het-group") for a in argv)
