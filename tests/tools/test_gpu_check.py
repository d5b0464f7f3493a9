"""tools/gpu_check.py: its help, its refusal on a machine without CUDA, its pure pieces (peak FLOP/s,
MFU, the oracle's comparisons, the verdict), and on CPU its self-test (--device cpu) through every step."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "gpu_check.py"
sys.path.insert(0, str(TOOL.parent))  # the tool's modules import each other as scripts do

import gpu_check  # noqa: E402 - after the path it lives on
import gpu_check_ranks  # noqa: E402
import gpu_check_steps  # noqa: E402


@pytest.mark.timeout(60)
def test_help_documents_model_dir_the_steps_the_exit_codes_and_the_json_summary():
    done = subprocess.run([sys.executable, str(TOOL), "--help"], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    for words in ("MODEL_DIR", "--out", "Exit codes: 0 every step passed; 1 a step failed", "2 this node",
                  "JSON summary", "verdict", "exit_code", "figures", "mfu", "peak_memory_gib"):
        assert words in text, words
    for step in gpu_check.expected_steps(("gloo", "nccl")):
        assert step in text, step


@pytest.mark.timeout(60)
def test_without_cuda_it_stops_at_once_with_exit_code_2_saying_so_in_one_line_and_in_the_json(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    out = tmp_path / "summary.json"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-X", "importtime", str(TOOL), str(tmp_path / "model"), "--out", str(out)],
                          capture_output=True, text=True, timeout=50)
    elapsed = time.monotonic() - started
    assert done.returncode == 2, done.stderr[-2000:]
    assert elapsed < 10
    lines = done.stderr.splitlines()
    assert "no CUDA device: tools/gpu_check.py needs a node with >= 4 GPUs" in lines
    imported = {line.rsplit("|", 1)[-1].strip() for line in lines if line.startswith("import time:")}
    assert "json" in imported  # -X importtime did list the imports
    assert not [name for name in imported if name == "vllm" or name.startswith("vllm.")]
    summary = json.loads(done.stdout)
    assert json.loads(out.read_text()) == summary
    assert (summary["verdict"], summary["exit_code"]) == ("unfit", 2)
    assert summary["reason"] == gpu_check.NO_CUDA
    assert [(s["name"], s["ok"], s["error"]) for s in summary["steps"]] == [("preflight", False, gpu_check.NO_CUDA)]
    assert summary["environment"]["torch"] == torch.__version__ and summary["environment"]["gpus"] == []


def test_only_an_nvidia_device_node_or_driver_entry_makes_it_look_further_for_cuda(tmp_path):
    (tmp_path / "nvidiactl").touch()
    assert gpu_check.nvidia_driver_present((str(tmp_path / "nvidia0"), str(tmp_path / "nvidiactl")))
    assert not gpu_check.nvidia_driver_present((str(tmp_path / "nvidia0"), str(tmp_path / "driver")))


def test_peak_flops_are_looked_up_by_gpu_name_the_most_specific_name_first():
    peak = gpu_check_steps.peak_bf16_flops
    assert peak("NVIDIA H100 80GB HBM3") == 989.4e12
    assert peak("NVIDIA H100 PCIe") == 756e12
    assert peak("NVIDIA H100 NVL") == 835.5e12
    assert peak("NVIDIA H200") == peak("NVIDIA GH200 480GB") == 989.4e12
    assert peak("NVIDIA A100-SXM4-80GB") == peak("NVIDIA A100 80GB PCIe") == 312e12
    assert peak("NVIDIA L40S") == 362e12
    assert peak("NVIDIA H20") is None and peak("Tesla V100-SXM2-32GB") is None and peak("cpu") is None


def test_mfu_is_six_times_parameters_times_tokens_over_the_step_time_and_the_peak_of_both_gpus():
    value = gpu_check_steps.mfu(parameters=1_235_814_400, tokens=16_384, step_s=0.5, peak_flops=989.4e12, gpus=2)
    assert value == pytest.approx(6 * 1_235_814_400 * 16_384 / 0.5 / (2 * 989.4e12))
    assert 0.12 < value < 0.13


def test_gpus_go_one_to_each_trainer_rank_then_two_to_the_replica_as_cuda_visible_devices_names_them():
    assert gpu_check.gpu_blocks(["4", "5", "6", "7", "0"]) == {"trainer0": "4", "trainer1": "5", "vllm": "6,7"}
    assert gpu_check.gpu_blocks(["GPU-a", "GPU-b", "GPU-c", "GPU-d"])["vllm"] == "GPU-c,GPU-d"
    with pytest.raises(ValueError, match="3 GPUs visible, 4 needed"):
        gpu_check.gpu_blocks(["0", "1", "2"])


def test_a_gpu_run_checks_gloo_first_then_nccl_with_the_negative_control_after_the_first_transfer():
    assert gpu_check.expected_steps(gpu_check_steps.Mode.of("cuda").transports) == [
        "preflight", "trainer_start", "vllm_start", "grpo_steps", "trainer_checkpoint", "vllm_reference",
        "logprob_mismatch", "pack_unpack_bandwidth", "gloo_transfer", "gloo_oracle", "negative_control",
        "nccl_transfer", "nccl_oracle"]
    assert gpu_check_steps.Mode.of("cpu") == gpu_check_steps.Mode(device="cpu", dtype="float32", transports=("gloo",))


def test_the_oracle_names_differing_missing_moved_and_unplanned_parameters_per_tp_rank():
    reference = [{"a": "1", "b": "2"}, {"a": "3", "b": "4"}]
    after = [{"a": "1", "b": "2"}, {"a": "3", "b": "x", "c": "5"}]
    assert gpu_check_steps.digest_mismatch(after, reference) == [[], ["b", "c"]]
    with pytest.raises(ValueError, match="1 TP ranks"):
        gpu_check_steps.digest_mismatch(after[:1], reference)
    assert gpu_check_steps.moved_pointers([{"a": 10, "b": 20}], [{"a": 10, "b": 24}]) == [["b"]]
    assert gpu_check_steps.unplanned([{"a": "", "b.weight@kernel": ""}, {"a": "", "c": ""}], ["a", "b.weight"]) == ["c"]


def test_the_negative_control_passes_only_when_the_oracle_flags_exactly_the_corrupted_parameter():
    caught, what = gpu_check_steps.negative_control([["model.norm.weight"], ["model.norm.weight"]], "model.norm.weight")
    assert caught and "TP rank(s) [0, 1]" in what
    missed, what = gpu_check_steps.negative_control([[], []], "model.norm.weight")
    assert not missed and "missed" in what
    too_much, what = gpu_check_steps.negative_control([["model.norm.weight", "x"], []], "model.norm.weight")
    assert not too_much and "expected only" in what


def test_logprob_mismatch_compares_the_completion_tail_of_the_trainers_sequence_logprobs():
    trainer = [[-9.0, -1.0, -2.0], [-9.0, -9.0, -0.5]]  # prompt tokens first, then the completion's
    vllm = [[-1.5, -2.0], [-0.25]]
    assert gpu_check_steps.logprob_mismatch(trainer, vllm) == {"tokens": 3, "max_abs": 0.5, "mean_abs": 0.25}
    assert gpu_check_steps.logprob_mismatch([[]], [[]])["max_abs"] is None
    with pytest.raises(ValueError, match="sequence 0"):
        gpu_check_steps.logprob_mismatch([[-1.0]], [[-1.0, -2.0]])


def _step(name: str, ok: bool | None, error: str | None = None, **extra) -> dict:
    return {"name": name, "ok": ok, "seconds": 1.0, "figures": {}, "error": error, "traceback": None, **extra}


def test_the_verdict_is_unfit_before_fail_before_pass_and_a_pass_needs_every_expected_step():
    expected = gpu_check.expected_steps(("gloo", "nccl"))
    passing = [_step(name, True) for name in expected]
    assert gpu_check.verdict(passing, expected) == ("pass", 0, "all 13 steps passed")
    failing = passing[:12] + [_step("nccl_oracle", False, "2 parameter(s) differ")]
    assert gpu_check.verdict(failing, expected) == ("fail", 1, "nccl_oracle: 2 parameter(s) differ")
    skipped = passing[:8] + [_step(name, None, "not run: budget") for name in expected[8:]]
    assert gpu_check.verdict(skipped, expected)[:2] == ("fail", 1)
    assert gpu_check.verdict(passing[:-1], expected) == ("fail", 1, "not run: nccl_oracle")
    unfit = [_step("preflight", False, gpu_check.NO_CUDA, unfit=True)]
    assert gpu_check.verdict(unfit, expected) == ("unfit", 2, gpu_check.NO_CUDA)


def test_the_summary_is_strict_json_even_when_a_figure_is_nan():
    steps = [_step("preflight", True), _step("grpo_steps", False, "step 2 loss = nan")]
    steps[1]["figures"] = {"steps": [{"loss": math.nan, "kl": math.inf}]}
    result = gpu_check.summary(model_dir="m", device="cuda", budget_s=600, seconds=12.34, environment={},
                               steps=steps, expected=["preflight", "grpo_steps"])
    text = json.dumps(result, allow_nan=False)
    assert json.loads(text)["steps"][1]["figures"]["steps"][0] == {"loss": "nan", "kl": "inf"}
    assert (result["verdict"], result["exit_code"], result["seconds"]) == ("fail", 1, 12.3)


@pytest.mark.timeout(120)
def test_the_vllm_side_plans_the_same_transfer_from_the_init_info_the_check_sends_it():
    pytest.importorskip("vllm")
    from hpcrl.config.model_shapes import PRESETS
    from hpcrl.plan.transfer_layout import InferenceLayout, TrainerLayout
    from hpcrl.plan.transfer_planner import plan as plan_transfer
    from hpcrl.transfer.vllm_engine import HpcrlInitInfo, init_info

    for preset in ("llama3-1b", "qwen2.5-0.5b"):
        plan = gpu_check_ranks.make_plan(PRESETS[preset], "bfloat16")
        info = HpcrlInitInfo(**init_info(host="127.0.0.1", port=1, replica=0, **gpu_check_ranks.init_info_args(plan)))
        # What HpcrlWeightTransferEngine.init_transfer_engine plans in each vLLM worker.
        theirs = plan_transfer(TrainerLayout(**info.trainer), InferenceLayout(**info.inference), PRESETS[preset],
                               wire_dtype=info.wire_dtype, bucket_bytes=info.bucket_bytes)
        assert theirs.digest == info.digest == plan.digest
        assert (plan.trainer.world_size, plan.inference.tensor_parallel) == (2, 2)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_on_cpu_every_step_passes_on_the_tiny_model_and_the_oracle_catches_the_corrupted_send(tiny_model, tmp_path):
    pytest.importorskip("vllm")
    out = tmp_path / "summary.json"
    done = subprocess.run([sys.executable, str(TOOL), str(tiny_model), "--device", "cpu", "--work", str(tmp_path),
                           "--out", str(out)], capture_output=True, text=True, timeout=590)
    summary = json.loads(out.read_text())
    failed = [(s["name"], s["error"]) for s in summary["steps"] if s["ok"] is not True]
    assert done.returncode == 0, (failed, done.stderr[-3000:])
    assert summary["verdict"] == "pass"
    steps = {s["name"]: s["figures"] for s in summary["steps"]}
    assert list(steps) == gpu_check.expected_steps(("gloo",))
    assert steps["gloo_oracle"]["mismatch"] == [[], []] and steps["gloo_oracle"]["generation_equal"]
    assert steps["negative_control"]["mismatch"] == [["model.norm.weight"], ["model.norm.weight"]]
    assert steps["gloo_transfer"]["bytes_sent"] and sum(steps["gloo_transfer"]["bytes_sent"]) == sum(
        steps["gloo_transfer"]["bytes_received"])
    assert steps["logprob_mismatch"]["max_abs"] < 1e-4  # float32 on both sides
    assert not (tmp_path / "trained-checkpoint").exists()
