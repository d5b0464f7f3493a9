"""GPU placement of one task (hpcrl.plan.placement): its step's GPUs narrowed by its local rank. Pure: a table."""

from __future__ import annotations

import pytest

from hpcrl.plan.placement import PlacementError, place_gpus

# (what the step shows, GPUs per task, tasks on the node, local rank) -> the task's CUDA_VISIBLE_DEVICES
CASES = [
    ({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, 1, 8, 0, "0"),            # trainer rank, first of a node
    ({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, 1, 8, 7, "7"),            # trainer rank, last of a node
    ({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, 2, 4, 1, "2,3"),          # 4 replicas x TP 2, the second
    ({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, 8, 1, 0, "0,1,2,3,4,5,6,7"),  # one replica x TP 8
    ({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, 2, 2, 1, "6,7"),                  # a node shared: not numbered from 0
    ({"CUDA_VISIBLE_DEVICES": "3,1,2,0"}, 2, 2, 0, "3,1"),                  # Slurm's order, as written
    ({"CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb"}, 1, 2, 1, "GPU-bb"),         # UUIDs
    ({"CUDA_VISIBLE_DEVICES": "5"}, 1, 8, 3, "5"),                          # bound by Slurm (--gpus-per-task)
    ({"CUDA_VISIBLE_DEVICES": "2,3"}, 2, 4, 3, "2,3"),                      # bound by Slurm, a TP 2 replica
    ({"SLURM_STEP_GPUS": "4,5,6,7"}, 1, 4, 2, "6"),                         # no CUDA_VISIBLE_DEVICES: the step's
    ({"SLURM_JOB_GPUS": "0,1"}, 1, 2, 1, "1"),                              # only the job's
    ({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, 2, 3, 2, "4,5"),          # 3 replicas on 8 GPUs: 6,7 idle
    ({"CUDA_VISIBLE_DEVICES": "0,1,2,3", "SLURM_STEP_GPUS": "4,5,6,7"}, 1, 4, 0, "0"),  # what CUDA sees wins
]


@pytest.mark.parametrize("env,gpus,tasks,local,expected", CASES)
def test_each_task_takes_the_block_of_its_local_rank_from_what_slurm_gave_its_step(env, gpus, tasks, local, expected):
    assert place_gpus(env, gpus_per_task=gpus, local_rank=local, tasks_on_node=tasks).cuda_visible_devices == expected


def test_the_tasks_of_one_node_get_disjoint_blocks_that_cover_what_they_need():
    env = {"CUDA_VISIBLE_DEVICES": "8,9,10,11,12,13,14,15"}
    blocks = [place_gpus(env, gpus_per_task=2, local_rank=k, tasks_on_node=4).mine for k in range(4)]
    assert sorted(g for block in blocks for g in block) == sorted(env["CUDA_VISIBLE_DEVICES"].split(","))


BAD = [
    ({}, 1, 2, 0, "no GPU"),                                                # a GPU task on a step without GPUs
    ({"CUDA_VISIBLE_DEVICES": ""}, 1, 1, 0, "CUDA_VISIBLE_DEVICES="),       # Slurm hid every GPU
    ({"CUDA_VISIBLE_DEVICES": "0,1,2"}, 2, 2, 1, "needs 2 GPU(s)"),         # fewer than the node's tasks need
    ({"CUDA_VISIBLE_DEVICES": "0,0,1,1"}, 1, 4, 0, "names a GPU twice"),
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, 1, 2, 2, "local rank 2 of 2"),        # a local rank beyond the node's tasks
]


@pytest.mark.parametrize("env,gpus,tasks,local,words", BAD)
def test_a_step_that_cannot_hold_the_task_is_a_clear_error(env, gpus, tasks, local, words):
    with pytest.raises(PlacementError) as caught:
        place_gpus(env, gpus_per_task=gpus, local_rank=local, tasks_on_node=tasks, what="inference rank 1")
    assert words in str(caught.value) and "inference rank 1" in str(caught.value)
