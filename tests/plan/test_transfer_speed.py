"""The predicted sync per transport (hpcrl.plan.transfer.speed): by table, from stated bandwidths."""

from __future__ import annotations

import pytest

from hpcrl.config.schema import Config, DataConfig, InferenceConfig, ModelConfig, RunConfig, TrainerConfig
from hpcrl.errors import PlanError
from hpcrl.plan.transfer.speed import Bandwidths, host_round_trip_warning, predict_sync

# Round figures so the expected seconds read off: InfiniBand 50 GB/s per GPU, NVLink 500 GB/s, PCIe 25 GB/s,
# Ethernet 3.125 GB/s (25 Gbit/s) per node.
BW = Bandwidths(infiniband_per_gpu=50e9, nvlink_per_gpu=500e9, pcie=25e9, ethernet_per_node=3.125e9)
G50 = 50_000_000_000

# (case, sent per trainer rank, received per inference rank, trainer ranks per node, inference ranks per node,
#  trainer on GPUs, inference on GPUs, {label: (slowest trainer rank s, slowest inference rank s, sync s)})
CASES = [
    ("one GPU to one GPU", [G50], [G50], 1, 1, True, True, {
        "nccl": (1, 1, 1),                     # 50 GB at 50 GB/s
        "nccl-nvlink": (0.1, 0.1, 0.1),        # at 500 GB/s
        "gloo": (2 + 16, 16 + 2, 2 + 16 + 2),  # copy out 2 s, TCP 16 s, copy in 2 s
        "ucx": (2 + 1, 1 + 2, 2 + 1 + 2)}),    # copy out, RDMA at the InfiniBand rate, copy in
    ("two trainer ranks on one node share its Ethernet", [G50 // 2] * 2, [G50], 2, 1, True, True, {
        "nccl": (0.5, 1, 1),
        "gloo": (1 + 16, 16 + 2, 1 + 16 + 2),
        "ucx": (1 + 0.5, 1 + 2, 1 + 1 + 2)}),
    ("two trainer ranks on two nodes: each its own Ethernet", [G50 // 2] * 2, [G50], 1, 1, True, True, {
        "gloo": (1 + 8, 16 + 2, 1 + 16 + 2)}),
    ("two inference GPUs on one node", [G50], [G50 // 2] * 2, 1, 2, True, True, {
        "nccl": (1, 0.5, 1),
        "gloo": (2 + 16, 16 + 1, 2 + 16 + 1)}),
    ("CPU groups: no copies, no NCCL", [G50], [G50], 1, 1, False, False, {
        "gloo": (16, 16, 16),
        "ucx": (1, 1, 1)}),
    ("GPU trainer, CPU inference: a copy out only", [G50], [G50], 1, 1, True, False, {
        "gloo": (2 + 16, 16, 2 + 16),
        "ucx": (2 + 1, 1, 2 + 1)}),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_each_transport_predicts_every_rank_and_the_sync_from_the_stated_bandwidths(case):
    _, sent, received, trainer_per_node, inference_per_node, trainer_gpus, inference_gpus, expected = case
    got = {p.label: p for p in predict_sync(
        sent_per_trainer_rank=sent, received_per_inference_rank=received, trainer_ranks_per_node=trainer_per_node,
        inference_ranks_per_node=inference_per_node, trainer_on_gpus=trainer_gpus, inference_on_gpus=inference_gpus,
        bandwidths=BW)}
    for label, (trainer_s, inference_s, sync_s) in expected.items():
        p = got[label]
        assert len(p.trainer_rank_s) == len(sent) and len(p.inference_rank_s) == len(received)
        assert (max(p.trainer_rank_s), max(p.inference_rank_s), p.sync_s) == pytest.approx(
            (trainer_s, inference_s, sync_s)), label


def test_nccl_is_predicted_only_with_gpus_on_both_ends_and_nvlink_is_marked_same_node_only():
    def labels(trainer_gpus: bool, inference_gpus: bool) -> list[str]:
        return [p.label for p in predict_sync(sent_per_trainer_rank=[1], received_per_inference_rank=[1],
                                              trainer_ranks_per_node=1, inference_ranks_per_node=1,
                                              trainer_on_gpus=trainer_gpus, inference_on_gpus=inference_gpus)]

    assert labels(True, True) == ["nccl", "nccl-nvlink", "gloo", "ucx"]
    assert labels(True, False) == labels(False, True) == labels(False, False) == ["gloo", "ucx"]
    nvlink = predict_sync(sent_per_trainer_rank=[1], received_per_inference_rank=[1], trainer_ranks_per_node=1,
                          inference_ranks_per_node=1, trainer_on_gpus=True, inference_on_gpus=True)[1]
    assert nvlink.same_node_only and nvlink.transport == "nccl"


def test_each_prediction_states_its_bandwidths():
    paths = {p.label: p.path for p in predict_sync(
        sent_per_trainer_rank=[1], received_per_inference_rank=[1], trainer_ranks_per_node=1,
        inference_ranks_per_node=1, trainer_on_gpus=True, inference_on_gpus=True)}
    assert paths["nccl"] == "NCCL over InfiniBand NDR, 50 GB/s per GPU (400 Gbit/s, a port per GPU)"
    assert paths["nccl-nvlink"] == "NCCL over NVLink, 450 GB/s per H100 and direction (within a node only)"
    assert paths["gloo"] == ("GPU -> host 50 GB/s (PCIe Gen5 x16, pinned), TCP 25 Gbit/s per node shared by its "
                             "ranks, host -> GPU 50 GB/s")
    assert paths["ucx"].startswith("GPU -> host 50 GB/s") and "RDMA from host memory 50 GB/s per rank" in paths["ucx"]


def test_a_prediction_without_ranks_is_a_plan_error():
    with pytest.raises(PlanError, match="at least one rank"):
        predict_sync(sent_per_trainer_rank=[], received_per_inference_rank=[1], trainer_ranks_per_node=1,
                     inference_ranks_per_node=1, trainer_on_gpus=True, inference_on_gpus=True)


def config_with(trainer_gpus: int, inference_gpus: int, written: str) -> Config:
    return Config(run=RunConfig(name="w"), model=ModelConfig(preset="qwen2.5-7b"),
                  data=DataConfig(source="builtin:arithmetic"), trainer=TrainerConfig(gpus_per_node=trainer_gpus),
                  inference=InferenceConfig(gpus_per_node=inference_gpus, weight_transport=written))


@pytest.mark.parametrize("trainer_gpus, inference_gpus, written, words", [
    (8, 8, "gloo", ["GPU -> host -> TCP -> host -> GPU", "pinned host memory", 'set weight_transport = "nccl"']),
    (8, 8, "ucx", ["GPU -> host -> UCX (it moves CPU tensors only) -> host -> GPU", 'set weight_transport = "nccl"']),
    (8, 8, "auto", []),
    (8, 8, "nccl", []),
    (0, 0, "gloo", []),
    (8, 0, "gloo", []),  # the inference group on CPU: the host is the only way
])
def test_the_host_round_trip_is_warned_of_only_when_chosen_with_gpus_on_both_ends(trainer_gpus, inference_gpus,
                                                                                  written, words):
    warning = host_round_trip_warning(config_with(trainer_gpus, inference_gpus, written))
    assert bool(warning) == bool(words), warning
    for word in words:
        assert word in warning
