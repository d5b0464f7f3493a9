"""`hpcrl plan` on the command line: output, JSON, speed, no heavy imports."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from import_helpers import modules_imported_by

REPO = Path(__file__).resolve().parents[2]


def hpcrl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcrl", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.timeout(60)
def test_plan_of_the_70b_config_prints_every_component_with_its_gpus_cpus_and_memory():
    done = hpcrl("plan", "configs/llama70b_grpo.toml", "--cluster", "generic")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "70.55 B parameters" in out
    # component, het group, nodes, tasks/node, tasks, GPUs/task, CPUs/task, mem/node (the config says "0": all)
    for line in ("head         0     1          1     1         0         8       16G",
                 "trainer      1     8          8    64         1        12         0",
                 "inference    2     4          1     4         8        96         0",
                 "reward       3     1          1     1         0        32      128G"):
        assert line in out
    assert "trainer mesh: 64 ranks = dp_replicate 1 x dp_shard 64" in out
    assert "trainer memory per GPU" in out and "inference memory per GPU" in out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport, path", [("gloo", "GPU -> host -> TCP -> host -> GPU"),
                                             ("ucx", "GPU -> host -> UCX (it moves CPU tensors only) -> host -> GPU")])
def test_plan_warns_of_the_host_round_trip_when_gloo_or_ucx_is_written_for_gpu_groups(transport, path):
    done = hpcrl("plan", "configs/llama8b_grpo.toml", "--set", f'inference.weight_transport="{transport}"')
    assert done.returncode == 0, done.stderr
    warning = next(line for line in done.stdout.splitlines() if line.startswith("warning: "))
    assert f'inference.weight_transport = "{transport}"' in warning and path in warning
    assert "pinned host memory" in warning and 'set weight_transport = "nccl"' in warning


@pytest.mark.timeout(60)
def test_plan_of_a_gpu_config_left_on_auto_warns_of_nothing():
    done = hpcrl("plan", "configs/llama8b_grpo.toml", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["warnings"] == []


@pytest.mark.timeout(60)
def test_plan_json_is_machine_readable():
    done = hpcrl("plan", "configs/llama70b_grpo.toml", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["model"]["parameters"] == 70_553_706_496
    assert [c["name"] for c in data["components"]] == ["head", "trainer", "inference", "reward"]
    assert data["trainer_memory"]["fits"] is True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("extra", [[], ["--json"]])
def test_plan_of_the_70b_config_takes_well_under_a_second_of_cpu(extra):
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = hpcrl("plan", "configs/llama70b_grpo.toml", *extra)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert done.returncode == 0, done.stderr
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu < 1.0, f"hpcrl plan took {cpu:.2f} s of CPU"


@pytest.mark.timeout(60)
def test_plan_imports_no_vendor_library():
    code = "from hpcrl.cli.main import main; main(['plan', 'configs/llama70b_grpo.toml', '--json'])"
    assert modules_imported_by(code, ("torch", "vllm", "torchtitan", "zmq", "submitit", "transformers")) == []


@pytest.mark.timeout(60)
def test_a_bad_command_line_is_an_error_not_a_traceback():
    done = hpcrl("plan")
    assert done.returncode == 2 and "usage:" in done.stderr and "Traceback" not in done.stderr
    done = hpcrl("plan", "configs/nope.toml")
    assert done.returncode == 2
    assert done.stderr.startswith("hpcrl: error: configs/nope.toml: file not found")


@pytest.mark.timeout(60)
def test_a_reader_that_closed_its_end_of_the_pipe_is_no_error():
    """`hpcrl plan CONFIG --transfer | head -1`: what was read is the product; no traceback for the rest."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to stdout now fails with EPIPE
    try:
        done = subprocess.run([sys.executable, "-m", "hpcrl", "plan", "configs/tiny_grpo.toml", "--transfer"],
                              cwd=REPO, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    finally:
        os.close(write_end)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


# tiny_grpo on CPU needs about 1.0 GiB per trainer node and 1.1 GiB per inference node.
TOO_SMALL_NODES = ("--set", "cluster.mem_per_node_gib=0.5")


@pytest.mark.timeout(60)
def test_a_plan_that_does_not_fit_is_printed_and_exits_3():
    done = hpcrl("plan", "configs/tiny_grpo.toml", *TOO_SMALL_NODES)
    assert done.returncode == 3, done.stderr
    assert "trainer memory per CPU node: 1.02 GiB of 512.00 MiB: DOES NOT FIT" in done.stdout
    as_json = hpcrl("plan", "configs/tiny_grpo.toml", *TOO_SMALL_NODES, "--json")
    assert as_json.returncode == 3 and json.loads(as_json.stdout)["fits"] is False
    assert "exit status: 0 when the plan fits, 3 when" in hpcrl("plan", "--help").stdout


@pytest.mark.timeout(60)
def test_a_kv_cache_shorter_than_one_sequence_does_not_fit():
    # 70B over TP 2: 4.3 GiB of KV cache per GPU holds 28,126 tokens; max_model_len 1024 + 40000.
    done = hpcrl("plan", "configs/llama70b_grpo.toml", "--set", "inference.tensor_parallel=2",
                 "--set", "inference.max_tokens=40000")
    assert done.returncode == 3
    assert "inference memory per GPU: 72.00 GiB of 72.00 GiB: DOES NOT FIT" in done.stdout
    assert "the KV cache holds 28126 tokens per replica, fewer than one sequence of 41024" in done.stdout


def _submit_dry_run(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": "/nonexistent"}  # no sbatch: the local executor
    return subprocess.run([sys.executable, "-m", "hpcrl", "submit", "configs/tiny_grpo.toml", "--dry-run",
                           "--set", f"run.run_dir={run_dir}", *extra], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env=env)


@pytest.mark.timeout(60)
def test_submit_refuses_a_plan_that_does_not_fit_with_the_figures_and_the_keys_to_change(tmp_path: Path):
    done = _submit_dry_run(tmp_path / "run", *TOO_SMALL_NODES)
    assert done.returncode == 2 and done.stdout == ""
    error = done.stderr.strip()
    assert len(error.splitlines()) == 1 and "Traceback" not in error
    assert error.startswith("hpcrl: error: configs/tiny_grpo.toml: the memory plan says DOES NOT FIT: ")
    for words in ("the trainer needs 1.0 GiB per CPU node, more than its 0.5 GiB (cluster.mem_per_node_gib)",
                  "trainer.activation_checkpointing = true", "trainer.micro_batch_size",
                  "each inference CPU node needs 1.1 GiB", "inference.tensor_parallel",
                  "--set run.ignore_memory_plan=true"):
        assert words in error
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(60)
def test_submit_takes_a_plan_that_does_not_fit_when_told_to_ignore_it(tmp_path: Path):
    done = _submit_dry_run(tmp_path / "run", *TOO_SMALL_NODES, "--set", "run.ignore_memory_plan=true")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "run" / "launch.json").is_file()
    assert "ignore_memory_plan = true" in (tmp_path / "run" / "config.toml").read_text()


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() == 0, reason="root may write any directory: nothing to refuse")
def test_submit_refuses_a_run_directory_it_cannot_write_naming_the_key(tmp_path: Path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    done = _submit_dry_run(locked / "run")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"hpcrl: error: configs/tiny_grpo.toml: run.run_dir: {locked / 'run'} cannot be "
                                  f"written by this user (its nearest existing directory, {locked}, is not)")


@pytest.mark.timeout(60)
def test_plan_and_submit_name_a_missing_data_column_with_the_file_and_the_columns_it_has(tmp_path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    data = tmp_path / "math.parquet"
    pq.write_table(pa.table({"question": ["1+1="], "solution": ["2"]}), data)
    config = tmp_path / "run.toml"
    config.write_text((REPO / "configs" / "tiny_grpo.toml").read_text())
    sets = ["--set", f"data.source={data}", "--set", "data.columns.prompt=question", "--set",
            f"run.run_dir={tmp_path / 'run'}"]
    for command in (["plan", str(config)], ["submit", str(config), "--dry-run"]):
        done = hpcrl(*command, *sets)
        assert done.returncode == 2, (command, done.stdout, done.stderr)
        assert "data.columns.answer" in done.stderr and str(data) in done.stderr, done.stderr
        assert "its columns: question, solution" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
    done = hpcrl("plan", str(config), *sets, "--set", "data.columns.answer=solution")
    assert done.returncode == 0, done.stderr


@pytest.mark.timeout(60)
def test_plan_refuses_the_chat_format_for_a_tokenizer_without_a_chat_template(tmp_path: Path):
    model = tmp_path / "base-model"
    model.mkdir()
    (model / "tokenizer_config.json").write_text('{"bos_token": "<s>"}')  # a base model's: no chat_template
    done = hpcrl("plan", "configs/tiny_grpo.toml", "--set", f"model.path={model}", "--set", "data.format=chat")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "data.format" in done.stderr and "has no chat template" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert hpcrl("plan", "configs/tiny_grpo.toml", "--set", f"model.path={model}").returncode == 0  # text: fine


@pytest.mark.timeout(60)
def test_plan_says_what_a_lost_node_costs_a_hetjob_and_a_split_job_with_spares():
    hetjob = hpcrl("plan", "configs/tiny_grpo.toml", "--cluster", "local")
    assert hetjob.returncode == 0, hetjob.stderr
    assert "recovery: a lost node requeues the hetjob" in hetjob.stdout
    spared = hpcrl("plan", "configs/tiny_grpo.toml", "--cluster", "local", "--set", 'cluster.layout="split"',
                   "--set", "cluster.spare_nodes=1", "--set", "inference.replicas=2", "--json")
    assert spared.returncode == 0, spared.stderr
    plan = json.loads(spared.stdout)
    assert plan["spare_nodes"] == 1 and plan["recovery"].startswith("1 spare node(s), idle in the allocation")
