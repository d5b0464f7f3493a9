"""Where the trainer group starts again inside the job after a lost rank (hpcrl.launch.recovery, pure)."""

from __future__ import annotations

import pytest

from hpcrl.launch.recovery import LostRank, NoRestart, describe_restart, plan_trainer_restart


def test_a_rank_killed_on_a_live_node_starts_the_group_again_in_place_without_a_spare():
    plan = plan_trainer_restart(nodes=["n1", "n2"], lost=[LostRank(1, "n2", node_lost=False, why="code 137")],
                                spares=["n6"])
    assert plan.nodes == ["n1", "n2"] and plan.in_place and plan.spares == ["n6"]
    assert describe_restart(plan) == "in place on n1,n2"
    # No spare is needed for it either.
    assert plan_trainer_restart(nodes=["n1", "n2"], lost=[LostRank(0, "n1", False, "code 1")], spares=[]).in_place


def test_a_lost_node_is_swapped_for_the_next_spare_in_its_place_in_the_node_list():
    plan = plan_trainer_restart(nodes=["n1", "n2", "n3"], lost=[LostRank(2, "n2", node_lost=True, why="silent")],
                                spares=["n6", "n7"])
    assert plan.nodes == ["n1", "n6", "n3"] and plan.replaced == {"n2": "n6"} and plan.spares == ["n7"]
    assert describe_restart(plan) == "on n1,n6,n3 (n2 -> spare n6)"


def test_two_ranks_of_one_lost_node_take_one_spare_and_a_rank_killed_beside_them_stays():
    lost = [LostRank(2, "n2", True, "silent"), LostRank(3, "n2", True, "silent"), LostRank(0, "n1", False, "code 143")]
    plan = plan_trainer_restart(nodes=["n1", "n2"], lost=lost, spares=["n6"])
    assert plan.nodes == ["n1", "n6"] and plan.spares == []


def test_a_lost_node_without_a_spare_left_has_no_restart_inside_the_job_so_the_job_is_requeued():
    with pytest.raises(NoRestart, match="n2 lost, 0 spare"):
        plan_trainer_restart(nodes=["n1", "n2"], lost=[LostRank(1, "n2", True, "silent")], spares=[])
    with pytest.raises(NoRestart, match="n1, n2 lost, 1 spare"):
        plan_trainer_restart(nodes=["n1", "n2"], lost=[LostRank(0, "n1", True, "s"), LostRank(1, "n2", True, "s")],
                             spares=["n6"])
    with pytest.raises(NoRestart, match="never named"):
        plan_trainer_restart(nodes=["n1", "n2"], lost=[LostRank(1, None, True, "step ended")], spares=["n6"])
    with pytest.raises(NoRestart, match="unknown"):
        plan_trainer_restart(nodes=[], lost=[LostRank(1, "n2", False, "code 9")], spares=["n6"])
