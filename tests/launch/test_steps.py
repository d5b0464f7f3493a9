"""The srun command lines the head starts groups with (pure)."""

from __future__ import annotations

from pathlib import Path

from hpcrl.config.components import Component
from hpcrl.launch.steps import local_gpu_blocks, replacement_argv, srun_argv, task_env
from hpcrl.slurm.spec import GroupSlot


def _slot(name: str, index: int, *, nodes: int, tasks_per_node: int, gpus_per_task: int, cpus_per_task: int, mem: str,
          ranks_per_replica: int = 1) -> GroupSlot:
    component = Component(name=name, index=index, nodes=nodes, tasks_per_node=tasks_per_node,
                          gpus_per_node=4 if gpus_per_task else 0, gpus_per_task=gpus_per_task,
                          cpus_per_task=cpus_per_task, mem=mem, role="")
    return GroupSlot(component=component, ranks_per_replica=ranks_per_replica, module="hpcrl.roles")


TRAINER = _slot("trainer", 1, nodes=2, tasks_per_node=4, gpus_per_task=1, cpus_per_task=8, mem="120G",
                ranks_per_replica=8)
INFERENCE = _slot("inference", 2, nodes=1, tasks_per_node=2, gpus_per_task=2, cpus_per_task=4, mem="8G")
REWARD = _slot("reward", 3, nodes=1, tasks_per_node=1, gpus_per_task=0, cpus_per_task=0, mem="")


def test_a_hetjob_group_is_one_step_on_its_own_het_group_with_one_log_per_rank():
    argv = srun_argv(TRAINER, layout="hetjob", run_dir=Path("/runs/x"), python="py")
    assert "--het-group=1" in argv and "--nodes=2" in argv and "--ntasks=8" in argv
    assert "--output=/runs/x/logs/trainer/rank%t.log" in argv  # %t: the rank within the group
    assert not any("%j" in a for a in argv)  # %j would be each component's own id
    assert argv[-5:] == ["py", "-u", "-m", "hpcrl.roles", "trainer"]


def test_a_split_group_is_one_step_on_its_node_range():
    argv = srun_argv(TRAINER, layout="split", run_dir=Path("/runs/x"), python="py", nodelist=["n2", "n3"])
    assert "--nodelist=n2,n3" in argv and not any(a.startswith("--het-group") for a in argv)


def test_a_gpu_step_asks_every_gpu_of_its_nodes_and_its_cpus_and_memory_as_sbatch_did():
    argv = srun_argv(TRAINER, layout="hetjob", run_dir=Path("/runs/x"), python="py")
    assert {"--gres=gpu:4", "--cpus-per-task=8", "--mem=120G"} <= set(argv)
    assert task_env(TRAINER, {"A": "1"}) == {"A": "1", "OMP_NUM_THREADS": "8"}


def test_a_cpu_step_without_known_resources_leaves_them_to_slurm():
    argv = srun_argv(REWARD, layout="hetjob", run_dir=Path("/runs/x"), python="py")
    assert not any(a.startswith(("--gres", "--cpus-per-task", "--mem")) for a in argv)
    assert "OMP_NUM_THREADS" not in task_env(REWARD, {})


def test_a_replica_started_again_goes_to_its_old_node_with_the_same_gres_and_its_share_of_memory():
    argv = replacement_argv(INFERENCE, 1, layout="hetjob", run_dir=Path("/runs/x"), python="py", node="n4")
    assert {"--overlap", "--het-group=2", "--nodelist=n4", "--ntasks=1", "--gres=gpu:4", "--cpus-per-task=4",
            "--mem=4096M"} <= set(argv)
    assert "--output=/runs/x/logs/inference/rank1.log" in argv and "--open-mode=append" in argv


def test_the_local_executor_gives_every_gpu_task_its_own_block_group_after_group():
    blocks = local_gpu_blocks([TRAINER, INFERENCE, REWARD], {"CUDA_VISIBLE_DEVICES": "2,3,4,5,6,7,8,9,10,11,12,13"})
    assert blocks[("trainer", 0)] == "2" and blocks[("trainer", 7)] == "9"
    assert blocks[("inference", 0)] == "10,11" and blocks[("inference", 1)] == "12,13"
    assert ("reward", 0) not in blocks
    assert local_gpu_blocks([REWARD], {}) == {}
    assert local_gpu_blocks([INFERENCE], {})[("inference", 1)] == "2,3"  # no variable: this machine's 0, 1, ...


def test_a_split_group_of_a_job_with_spares_is_started_so_that_a_lost_node_ends_only_its_own_tasks():
    argv = srun_argv(INFERENCE, layout="split", run_dir=Path("/runs/x"), python="py", nodelist=["n3"], no_kill=True)
    assert "--no-kill" in argv
    assert "--no-kill" not in srun_argv(INFERENCE, layout="split", run_dir=Path("/runs/x"), python="py",
                                        nodelist=["n3"])
    spare = replacement_argv(INFERENCE, 1, layout="split", run_dir=Path("/runs/x"), python="py", node="n6")
    assert "--nodelist=n6" in spare and "--gres=gpu:4" in spare and not any("het-group" in a for a in spare)


def test_a_trainer_group_started_again_inside_the_job_overlaps_its_old_step_and_appends_to_its_logs():
    argv = srun_argv(TRAINER, layout="split", run_dir=Path("/runs/x"), python="py", nodelist=["n2", "n6"],
                     no_kill=True, again=True)
    assert {"--overlap", "--open-mode=append", "--no-kill", "--nodelist=n2,n6", "--gres=gpu:4"} <= set(argv)
    assert "--overlap" not in srun_argv(TRAINER, layout="split", run_dir=Path("/runs/x"), python="py",
                                        nodelist=["n2", "n3"], no_kill=True)
