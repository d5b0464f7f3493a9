"""tools/bench/bench_vs_trl.py's pure parts: the process tree, steps to a 0.8 mean, the table; and the
TRL side's mapping of configs/tiny_grpo.toml (tools/bench/bench_vs_trl_trl.py, without TRL installed)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.config import load_config
from hpcrl.data.prompts import PromptStream

REPO = Path(__file__).resolve().parents[2]


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench = _tool("bench_vs_trl")


def _run(column: str, *, rewards: list[float | None], rc: int = 0, unsupported: dict | None = None, index: int = 1,
         seed: int = 0):
    run = bench.Run(column=column, index=index, seed=seed, command=["x"], out="/tmp/none", rc=rc, wall_s=61.0,
                    first_step_s=40.25, peak_rss=6 * 2**30, peak_processes=8, unsupported=unsupported)
    run.steps = [{"step": i + 1, "reward_mean": r, "generate_s": 0.08, "train_s": 0.03, "sync_s": 0.01,
                  "step_s": 0.15} for i, r in enumerate(rewards)]
    return run


def test_steps_to_mean_is_the_end_of_the_first_full_window_at_or_above_the_threshold():
    rewards = [0.0] * 5 + [1.0] * 20
    # windows ending at 10..: mean of the last ten; 8 of 10 ones first at step 13
    assert bench.steps_to_mean(rewards) == 13
    assert bench.steps_to_mean([1.0] * 9) is None, "a window needs ten steps"
    assert bench.steps_to_mean([0.5] * 30) is None
    assert bench.steps_to_mean([1.0] * 9 + [None] + [1.0] * 10) == 20, "a step without a reward breaks a window"
    assert bench.best_mean([0.0] * 5 + [1.0] * 20) == 1.0
    assert bench.best_mean([1.0] * 3) is None


def test_the_table_joins_runs_of_a_column_and_footnotes_a_column_trl_cannot_run():
    reason = {"error": "AttributeError: no weight_loader", "trl": ["trl/generation/vllm_generation.py:511"],
              "vllm": ["vllm/model_executor/layers/linear.py:1341"]}
    table, notes = bench.render_table([
        ("hpcrl run", [_run("hpcrl", rewards=[1.0] * 12), _run("hpcrl", rewards=[0.0] * 12, index=2)]),
        ("TRL, transformers generate", [_run("trl", rewards=[1.0] * 12, rc=1)]),
        ("TRL + vLLM colocate", [_run("vllm", rewards=[], rc=3, unsupported=reason)]),
    ])
    lines = table.splitlines()
    assert lines[0] == "| | hpcrl run (run 1 / run 2) | TRL, transformers generate | TRL + vLLM colocate |"
    assert lines[1] == "| --- | --- | --- | --- |"
    assert lines[2] == "| wall, all told | 61.0 s / 61.0 s | failed (exit 1) | n/a [1] |"
    assert lines[3].startswith("| launch -> first step | 40.2 s / 40.2 s |")
    assert "| 0.080 gen, 0.030 train, 0.010 sync / 0.080 gen, 0.030 train, 0.010 sync |" in lines[5]
    assert "| step 10 / not reached (best 0.00) |" in lines[6]
    assert "| 6.00 GiB, 8 processes / 6.00 GiB, 8 processes |" in lines[7]
    assert len(lines) == 8
    assert notes == ["[1] AttributeError: no weight_loader at trl/generation/vllm_generation.py:511, "
                     "vllm/model_executor/layers/linear.py:1341 (see tools/bench/bench_vs_trl.py's docstring; "
                     "--trl-vllm-sync reload measures it patched)"]


def test_runs_of_several_seeds_are_titled_with_them_and_summed_up_per_side():
    def late(step: int) -> list[float]:  # the 10-step mean reaches 0.8 at `step`
        return [0.0] * (step - 8) + [1.0] * 8

    hpcrl = [_run("hpcrl", rewards=late(30), seed=0), _run("hpcrl", rewards=late(12), index=2, seed=1),
             _run("hpcrl", rewards=[0.0] * 40, index=3, seed=2)]
    trl = [_run("trl", rewards=late(20), seed=0), _run("trl", rewards=late(25), index=2, seed=1),
           _run("trl", rewards=late(14), index=3, seed=2, rc=1)]
    table, _ = bench.render_table([("hpcrl run", hpcrl), ("TRL", trl)])
    assert table.splitlines()[0] == ("| | hpcrl run (run 1 / run 2 / run 3), seeds 0 / 1 / 2 "
                                     "| TRL (run 1 / run 2 / run 3), seeds 0 / 1 / 2 |")
    assert bench.learning_summary([("hpcrl run", hpcrl), ("TRL", trl)]) == [
        "hpcrl run: steps to 0.8 at seed 0: 30, seed 1: 12, seed 2: not reached; min 12, median 30, max not reached",
        "TRL: steps to 0.8 at seed 0: 20, seed 1: 25; min 20, median 22.5, max 25",  # a failed run has none
    ]


@pytest.mark.timeout(30)
def test_the_process_tree_holds_the_children_and_grandchildren_of_the_launched_process():
    proc = subprocess.Popen(["sh", "-c", "sleep 20 & (sleep 20 &) ; sleep 20"], start_new_session=True)
    try:
        time.sleep(0.5)
        table = bench.proc_table()
        pids = bench.tree_pids(table, proc.pid)
        # sh, its two sleeps, and the sleep whose parent subshell exited (re-parented, same session)
        assert proc.pid in pids and len(pids) == 4, pids
        assert all(table[p][2] > 0 for p in pids), "every process has an RSS"
        assert bench.tree_pids(table, 999_999_999) == set()
    finally:
        for pid in bench.tree_pids(bench.proc_table(), proc.pid):
            subprocess.run(["kill", "-9", str(pid)], check=False)
        proc.wait(timeout=10)


def test_without_its_venv_the_tool_prints_the_setup_command_and_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "VENV_TRL", tmp_path / "missing")
    monkeypatch.setattr(sys, "argv", ["bench_vs_trl.py", "--steps", "1"])
    assert bench.main() == 2
    assert "python tools/bench/bench_vs_trl.py --setup" in capsys.readouterr().err


def test_the_trl_side_gets_hpcrls_prompts_in_order_and_its_config_field_by_field(tmp_path):
    trl_side = _tool("bench_vs_trl_trl")
    config = load_config(REPO / "configs" / "tiny_grpo.toml")
    rows = trl_side.prompt_rows(config, steps=3)
    stream = PromptStream.from_config(config.data)
    batches = [stream.next_batch(8) for _ in range(3)]  # as hpcrl's controller draws them, a batch a step
    assert rows == [{"prompt": p.text, "prompt_text": p.text, "answer": p.answer} for batch in batches for p in batch]

    kwargs = trl_side.trl_config(config, steps=200, generation="vllm", out=tmp_path)
    assert {k: kwargs[k] for k in ("learning_rate", "adam_beta1", "adam_beta2", "max_grad_norm", "lr_scheduler_type",
                                   "warmup_steps", "num_generations", "max_completion_length", "temperature",
                                   "beta", "epsilon", "epsilon_high", "max_steps", "bf16", "shuffle_dataset")} == {
        "learning_rate": 1e-3, "adam_beta1": 0.9, "adam_beta2": 0.99, "max_grad_norm": 1.0,
        "lr_scheduler_type": "constant", "warmup_steps": 0, "num_generations": 16, "max_completion_length": 1,
        "temperature": 1.0, "beta": 0.0, "epsilon": 0.2, "epsilon_high": 0.28, "max_steps": 200, "bf16": False,
        "shuffle_dataset": False}
    # 128 completions a step, one optimizer step per generation
    assert kwargs["per_device_train_batch_size"] * kwargs["gradient_accumulation_steps"] == 128
    assert kwargs["use_vllm"] and kwargs["vllm_mode"] == "colocate" and kwargs["vllm_gpu_memory_utilization"] == 0.2

    reward = trl_side.reward_function(config)
    assert reward(prompts=["say 7:", "say 7:"], completions=["7", "3"], answer=["7", "7"],
                  prompt_text=["say 7:", "say 7:"]) == [1.0, 0.0]


SMOLLM2 = REPO / "models" / "smollm2-135m-instruct"


@pytest.mark.skipif(not (SMOLLM2 / "config.json").is_file(),
                    reason="models/smollm2-135m-instruct is missing: `python tools/fetch_model.py smollm2-135m-instruct`")
def test_on_the_real_models_config_trl_gets_hpcrls_conversations_and_scores_as_hpcrls_reward_does(tmp_path):
    """configs/smollm2_word_problems.toml is in the chat format: TRL is given the conversation hpcrl renders
    (the config's system prompt first), and math_verify scores the assistant's text against the answer."""
    trl_side = _tool("bench_vs_trl_trl")
    config = load_config(REPO / "configs" / "smollm2_word_problems.toml")
    rows = trl_side.prompt_rows(config, steps=1)
    first = PromptStream.from_config(config.data).next_batch(4)
    assert rows == [{"prompt": [{"role": "system", "content": config.data.system_prompt},
                                {"role": "user", "content": p.text}], "prompt_text": p.text, "answer": p.answer}
                    for p in first]
    kwargs = trl_side.trl_config(config, steps=4, generation="transformers", out=tmp_path)
    assert (kwargs["learning_rate"], kwargs["max_completion_length"], kwargs["num_generations"]) == (1e-5, 64, 8)
    assert kwargs["per_device_train_batch_size"] * kwargs["gradient_accumulation_steps"] == 32
    reward = trl_side.reward_function(config)
    answer = rows[0]["answer"]
    said = [[{"role": "assistant", "content": f"So the answer is {answer}."}],
            [{"role": "assistant", "content": f"So the answer is {int(answer) + 1}."}]]
    assert reward(prompts=[rows[0]["prompt"]] * 2, completions=said, answer=[answer] * 2,
                  prompt_text=[rows[0]["prompt_text"]] * 2) == [1.0, 0.0]
    # Both sides run on the config given, with the same overrides.
    for column in ("hpcrl", "trl"):
        argv = bench.command(column, tmp_path, 4, "trl", 0, REPO / "configs" / "smollm2_word_problems.toml",
                             ("eval.interval=0",))
        assert str(REPO / "configs" / "smollm2_word_problems.toml") in argv
        assert argv[argv.index("eval.interval=0") - 1] == "--set"
