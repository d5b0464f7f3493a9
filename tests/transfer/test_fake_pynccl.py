"""The strict fake PyNccl is stricter than NCCL where NCCL would hang or corrupt silently: two ranks
in two worker processes (tests/forked.py), on gloo (procs.fake_scenario)."""

from __future__ import annotations

import forked
import procs
import pytest
import torch
from fake_pynccl import FakeNcclError, StrictFakePyNccl

from hpcrl.rendezvous.meet import serve_store


def exchange(scenario: str) -> dict[int, tuple]:
    results, store = forked.context().Queue(), serve_store()
    children = [forked.process(procs.fake_scenario, scenario, r, store.address, results) for r in (0, 1)]
    for c in children:
        c.start()
    try:
        out = [results.get(timeout=60) for _ in children]
    finally:
        for c in children:
            c.join(timeout=10)
            if c.is_alive():
                c.kill()
    return {r[0]: r[1:] for r in out}


@pytest.mark.timeout(120)
def test_operations_match_per_pair_in_issue_order_and_move_the_bytes():
    out = exchange("in-order")
    assert out[0][0] == "ok" and out[1] == ("ok", [[0.0, 1.0, 2.0], [10.0, 11.0, 12.0, 13.0, 14.0]]), out


@pytest.mark.timeout(120)
def test_a_receiver_posting_a_pairs_operations_in_another_order_fails_naming_both_ranks():
    out = exchange("swapped")
    assert out[1][0] == "FakeNcclError", out
    assert "rank 1 receives 5 x torch.float32 as its receive #0 from rank 0, which sent 3" in out[1][1]


@pytest.mark.timeout(120)
def test_a_dtype_mismatch_fails_where_nccl_would_reinterpret_the_bytes():
    out = exchange("dtype")
    assert out[1][0] == "FakeNcclError" and "torch.bfloat16" in out[1][1], out


def test_an_operation_outside_a_group_or_after_destroy_fails_at_once():
    comm = StrictFakePyNccl.__new__(StrictFakePyNccl)  # the checks need no peer
    comm.rank, comm.world_size, comm.device = 0, 2, torch.device("cpu")
    comm.aborted = comm.disabled = False
    comm._depth, comm._ops, comm._stream = 0, [], None
    with pytest.raises(FakeNcclError, match="outside group_start"):
        comm.send(torch.zeros(1), 1)
    with pytest.raises(FakeNcclError, match="group_end without group_start"):
        comm.group_end()
    comm.group_start()
    with pytest.raises(FakeNcclError, match="tensor on meta"):
        comm.send(torch.zeros(1, device="meta"), 1)
    comm.destroy()
    with pytest.raises(FakeNcclError, match="destroyed"):
        comm.group_start()
