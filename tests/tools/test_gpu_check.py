"""tools/gpu/gpu_check.py: its help, its refusal on a machine without CUDA, its pure pieces (peak FLOP/s,
MFU, the oracle's comparisons, the verdict), on CPU its self-test (--device cpu) through every step, and
its partial mode (what one GPU without vLLM or a checkpoint can run) on CPU."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "gpu" / "gpu_check.py"
sys.path.insert(0, str(TOOL.parent))  # the tool's modules import each other as scripts do

import gpu_check  # noqa: E402 - after the path it lives on
import gpu_check_partial  # noqa: E402
import gpu_check_ranks  # noqa: E402
import gpu_check_steps  # noqa: E402


@pytest.mark.timeout(60)
def test_help_documents_model_dir_the_steps_the_exit_codes_and_the_json_summary():
    done = subprocess.run([sys.executable, str(TOOL), "--help"], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    for words in ("MODEL_DIR", "--out", "Exit codes: 0 every step passed; 1 a step failed", "2 this node",
                  "JSON summary", "verdict", "exit_code", "figures", "mfu", "peak_memory_gib", "--partial",
                  "In the partial mode 0 means that every step it ran passed", "not_run [{step, why}]", "--skip"):
        assert words in text, words
    for step in gpu_check.expected_steps(("gloo", "nccl")) + gpu_check_partial.step_names([4, 8]):
        assert step in text, step


@pytest.mark.timeout(60)
@pytest.mark.parametrize("partial", [[], ["--partial"]], ids=["full", "partial"])
def test_without_cuda_it_stops_at_once_with_exit_code_2_saying_so_in_one_line_and_in_the_json(tmp_path, partial):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    out = tmp_path / "summary.json"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-X", "importtime", str(TOOL), str(tmp_path / "model"), "--out", str(out),
                           *partial], capture_output=True, text=True, timeout=50)
    elapsed = time.monotonic() - started
    assert done.returncode == 2, done.stderr[-2000:]
    assert elapsed < 10
    lines = done.stderr.splitlines()
    assert "no CUDA device: tools/gpu/gpu_check.py needs a node with >= 4 GPUs" in lines
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


def test_a_partial_check_is_partial_when_every_step_it_ran_passed_and_fails_when_one_failed_or_none_ran():
    expected = gpu_check_partial.step_names([4, 8])
    assert expected == ["preflight", "trainer_step_b4", "trainer_step_b8", "pack_unpack_bandwidth",
                        "gloo_device_transfer", "tests"]
    ran = [_step("preflight", True), _step("trainer_step_b4", True), _step("pack_unpack_bandwidth", None, "not run: x")]
    assert gpu_check.verdict(ran, expected, partial=True) == ("partial", 0, "partial check: 1 of 5 steps ran and passed")
    assert gpu_check.verdict(ran, expected) == ("fail", 1, "not run: trainer_step_b8, pack_unpack_bandwidth, "
                                                           "gloo_device_transfer, tests")
    failed = ran + [_step("tests", False, "1 failed")]
    assert gpu_check.verdict(failed, expected, partial=True) == ("fail", 1, "tests: 1 failed")
    nothing = [_step("preflight", True)] + [_step(name, None, "not run: --skip") for name in expected[1:]]
    assert gpu_check.verdict(nothing, expected, partial=True) == ("fail", 1, "partial check: no step could run")
    unfit = [_step("preflight", False, gpu_check.NO_CUDA, unfit=True)]
    assert gpu_check.verdict(unfit, expected, partial=True)[:2] == ("unfit", 2)


def test_not_run_lists_what_the_mode_could_not_run_then_every_step_that_did_not_run_each_with_why():
    steps = [_step("preflight", True), _step("tests", None, "not run: --skip"), _step("gloo_device_transfer", True)]
    listed = [{"step": "vllm_start", "why": "vLLM is not installed"}]
    assert gpu_check.not_run(steps, listed) == [{"step": "vllm_start", "why": "vLLM is not installed"},
                                                {"step": "tests", "why": "--skip"}]
    stopped = gpu_check.not_run(steps, [], ["preflight", "gloo_device_transfer", "tests", "trainer_step_b4"])
    assert stopped == [{"step": "tests", "why": "--skip"},
                       {"step": "trainer_step_b4", "why": "not reached: the run stopped before it"}]
    result = gpu_check.summary(model_dir="", device="cuda", budget_s=420, seconds=1.0, environment={}, steps=steps,
                               expected=gpu_check_partial.step_names([4]), mode="partial", missing=listed)
    assert (result["verdict"], result["mode"], result["not_run"][1]) == ("partial", "partial",
                                                                         {"step": "tests", "why": "--skip"})


def test_an_unknown_step_to_skip_is_refused_naming_the_steps():
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--partial", "--skip", "pack"])
    args = gpu_check.parse_args(["--partial", "--device", "cpu", "--skip", "tests"])
    assert (args.preset, args.batches, args.skip, args.seq_len) == ("tiny-llama", [2], ["tests"], None)
    gpu_check.mode_defaults(args, partial=True)
    assert (args.seq_len, args.budget_s) == (64, 480.0)
    args = gpu_check.parse_args([])
    gpu_check.mode_defaults(args, partial=False)
    assert (args.preset, args.batches, args.seq_len, args.budget_s) == ("llama3-1b", [4, 8], 1024, 600.0)


def test_pytest_counts_come_from_the_closing_line_or_from_each_tests_verdict_when_cut_short():
    closing = "tests/a.py::test_x PASSED [ 50%]\n==== 3 passed, 2 skipped, 1 failed, 1 error, 4 deselected in 2.50s ====\n"
    assert gpu_check_partial.pytest_counts(closing) == {"passed": 3, "failed": 1, "error": 1, "skipped": 2}
    cut = "tests/a.py::test_x PASSED [ 10%]\ntests/a.py::test_y[gloo] SKIPPED (no) [ 20%]\ntests/b.py::test_z FAILED\n"
    assert gpu_check_partial.pytest_counts(cut) == {"passed": 1, "failed": 1, "error": 0, "skipped": 1}


def test_the_worst_pack_to_copy_ratio_is_found_anywhere_in_the_benchmarks_json():
    figures = {"plans": [{"pack_vs_copy": 0.9, "unpack_vs_copy": 0.6}, {"pack_vs_copy": 0.55}], "copy_gb_per_s": 2000}
    assert gpu_check_partial.worst_ratio(figures, "vs_copy") == 0.55
    assert gpu_check_partial.worst_ratio({"copy_gb_per_s": 1.0}, "vs_copy") is None


@pytest.mark.parametrize(("preset", "tp"), [("tiny-llama", 1), ("tiny-llama", 2), ("tiny-qwen2", 2)])
def test_the_receivers_expected_tensors_in_torch_are_the_plan_checks_element_ids(preset, tp):
    """The one-GPU transfer's oracle (torch, on the device) against hpcrl.plan.transfer.check's (numpy)."""
    import numpy as np
    import torch

    from hpcrl.config.model_shapes import PRESETS
    from hpcrl.plan.transfer.check import _hf_ids, vllm_expected
    from hpcrl.plan.transfer.layout import InferenceLayout, TrainerLayout
    from hpcrl.plan.transfer.planner import plan as plan_transfer

    shape = PRESETS[preset]
    plan = plan_transfer(TrainerLayout(dp_shard=1), InferenceLayout(replicas=1, tensor_parallel=tp),
                         shape, wire_dtype="float32", bucket_bytes=1 << 16)
    ids = _hf_ids(shape)
    hf = {name: torch.from_numpy(a.reshape(dims)) for (name, dims), a in zip(shape.hf_parameters(), ids.values())}
    for rank in range(tp):
        mine = gpu_check_ranks.expected_dests(plan, shape, hf, rank, fill=-1)
        theirs = vllm_expected(plan, shape, ids, rank)
        assert sorted(mine) == sorted(theirs) == sorted(d.name for d in plan.dests)
        for name, expected in theirs.items():
            assert np.array_equal(mine[name].numpy().reshape(expected.shape), expected), name


def test_the_brief_shows_each_steps_headline_figures_the_targets_and_what_did_not_run_grouped_by_why():
    engine = {"step_ms": 207.8, "tokens_per_s_per_rank": 39400.0, "peak_memory_gib": 39.4}
    plain = {"step_ms": 154.7, "tokens_per_s_per_rank": 52900.0, "peak_memory_gib": 39.9}
    steps = [_step("preflight", True), _step("trainer_step_b4", True), _step("tests", True)]
    steps[0]["figures"] = {"mode": "partial", "partial_because": ["1 CUDA device(s), the full check needs >= 4"]}
    steps[1]["figures"] = {"batch": 4, "engine": engine, "plain": plain, "engine_vs_plain": 1.343,
                           "target": {"engine_vs_plain_max": 1.05, "met": False}}
    steps[2]["figures"] = {"passed": 80, "failed": 0, "error": 0, "skipped": 3}
    result = gpu_check.summary(model_dir="", device="cuda", budget_s=420, seconds=300.0,
                               environment={"gpus": [{"index": 0, "name": "NVIDIA H200", "memory_gib": 139.8}],
                                            "torch": "2.11.0+cu130"},
                               steps=steps, expected=gpu_check_partial.step_names([4]), mode="partial",
                               missing=[{"step": "vllm_start", "why": "vLLM is not installed"},
                                        {"step": "grpo_steps", "why": "vLLM is not installed"}])
    text = "\n".join(gpu_check.brief(result))
    assert text.startswith("gpu_check partial check on NVIDIA H200 x1: torch 2.11.0+cu130")
    assert "engine 207.8 ms, 39.4k tok/s, 39.4 GiB | plain 154.7 ms, 52.9k tok/s, 39.9 GiB" in text
    assert "engine/plain 1.343 (<= 1.05: MISSED)" in text
    assert "80 passed, 0 failed, 0 errors, 3 skipped" in text
    assert "  vllm_start, grpo_steps: vLLM is not installed" in text
    assert text.endswith("gpu_check: partial (partial check: 2 of 4 steps ran and passed) in 300.0 s, exit code 0")
    assert len(text.splitlines()) < 15


@pytest.mark.timeout(120)
def test_the_tests_step_runs_pytest_on_its_list_and_counts_what_passed(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check_partial, "TESTS", ("tests/tools/test_gpu_check.py",))
    monkeypatch.setattr(gpu_check_partial, "TESTS_SELECT", ("-k", "peak_flops or mfu_is"))
    args = gpu_check.parse_args(["--partial", "--device", "cpu"])
    gpu_check.mode_defaults(args, partial=True)
    run = gpu_check_partial.PartialRun(args, gpu_check_steps.Check(100, time.monotonic()), tmp_path)
    figures = run.tests(time.monotonic() + 100)
    assert (figures["passed"], figures["failed"], figures["error"]) == (2, 0, 0), (tmp_path / "tests.log").read_text()


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
    from hpcrl.plan.transfer.layout import InferenceLayout, TrainerLayout
    from hpcrl.plan.transfer.planner import plan as plan_transfer
    from hpcrl.transfer.vllm_engine import HpcrlInitInfo, init_info

    for preset in ("llama3-1b", "qwen2.5-0.5b"):
        plan = gpu_check_ranks.make_plan(PRESETS[preset], "bfloat16")
        info = HpcrlInitInfo(**init_info(store="tcp://127.0.0.1:1", replica=0, **gpu_check_ranks.init_info_args(plan)))
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


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_on_cpu_the_partial_check_runs_what_it_can_and_says_partial_with_what_it_could_not_run_and_why(tmp_path):
    from hpcrl.config.model_shapes import PRESETS

    out = tmp_path / "summary.json"
    done = subprocess.run([sys.executable, str(TOOL), "--partial", "--device", "cpu", "--skip", "tests",
                           "--work", str(tmp_path), "--out", str(out), "--budget-s", "240"],
                          capture_output=True, text=True, timeout=290)
    summary = json.loads(out.read_text())
    assert done.returncode == 0, (summary["reason"], done.stderr[-3000:])
    assert json.loads(done.stdout) == summary
    assert set(summary) == {"verdict", "exit_code", "reason", "mode", "model_dir", "device", "budget_s", "seconds",
                            "environment", "steps", "not_run", "work_dir", "logs"}
    assert (summary["verdict"], summary["exit_code"], summary["mode"]) == ("partial", 0, "partial")
    steps = {s["name"]: s for s in summary["steps"]}
    assert list(steps) == gpu_check_partial.step_names([2])
    assert steps["preflight"]["figures"]["partial_because"][0] == "--partial"
    engine = steps["trainer_step_b2"]["figures"]["engine"]
    assert (engine["preset"], engine["batch_per_rank"], engine["seq_len"]) == ("tiny-llama", 2, 64)
    assert engine["step_ms"] > 0
    transfer = steps["gloo_device_transfer"]["figures"]
    assert transfer["element_exact"] and len(transfer["runs"]) == 2
    assert transfer["runs"][1]["bytes"] == 4 * PRESETS["tiny-llama"].num_parameters  # float32, each element once
    why = {entry["step"]: entry["why"] for entry in summary["not_run"]}
    for name in ("trainer_start", "vllm_start", "grpo_steps", "gloo_oracle", "negative_control"):
        assert why[name].startswith("--partial"), name
    assert why["tests"] == "--skip" and steps["tests"]["ok"] is None
    # The other helpers' benchmarks: each ran, or is not run saying why.
    assert steps["pack_unpack_bandwidth"]["ok"] is (None if "pack_unpack_bandwidth" in why else True)
    assert ("plain" in steps["trainer_step_b2"]["figures"]) != ("trainer_step_b2 (plain loop)" in why)
    lines = done.stderr.splitlines()
    assert lines[-1].startswith("gpu_check: partial (partial check: ") and lines[-1].endswith("exit code 0")
