"""Broken configs: each error names the file, the line, the dotted key and a fix; no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcrl.cli.main import main
from hpcrl.config import load_config
from hpcrl.errors import ConfigError

BASE = """\
[run]
name = "t"

[model]
preset = "tiny-llama"
dtype = "float32"

[trainer]
nodes = 1
gpus_per_node = 0
ranks_per_node = 1
steps = 10
lr = 1e-3
micro_batch_size = 8
global_batch_size = 64

[inference]
replicas = 1
tensor_parallel = 1
gpus_per_node = 0
max_tokens = 8

[reward]
function = "hpcrl.reward.builtin:exact_match"

[algorithm]
group_size = 8

[data]
source = "builtin:arithmetic"
max_prompt_tokens = 16
"""

GPU_BASE = BASE.replace("gpus_per_node = 0", "gpus_per_node = 8").replace(
    'preset = "tiny-llama"', 'preset = "qwen2.5-7b"').replace('dtype = "float32"', 'dtype = "bfloat16"').replace(
    "ranks_per_node = 1\n", "")


def edit(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


# (id, config text, --cluster, --set overrides, expected dotted key, words the message must hold,
#  expected line or None when the key is not in the file)
CASES = [
    ("typo in a key", edit(BASE, "lr = 1e-3", 'lr_schedul = "cosine"'), None, [],
     "trainer.lr_schedul", ["unknown key", "did you mean 'lr_schedule'"], 13),
    ("typo in a table name", edit(BASE, "[trainer]", "[trainr]"), None, [],
     "trainr", ["unknown key", "did you mean 'trainer'"], 8),
    ("string for an integer", edit(BASE, "nodes = 1", 'nodes = "two"'), None, [],
     "trainer.nodes", ["expected an integer", "'two'", "nodes = 1"], 9),
    ("string for a number", edit(BASE, "lr = 1e-3", 'lr = "fast"'), None, [],
     "trainer.lr", ["expected a number"], 13),
    ("integer for a boolean", edit(BASE, "steps = 10", "steps = 10\nactivation_checkpointing = 1"), None, [],
     "trainer.activation_checkpointing", ["expected true or false"], 13),
    ("misspelt choice", edit(BASE, "lr = 1e-3", 'lr = 1e-3\nlr_schedule = "cosin"'), None, [],
     "trainer.lr_schedule", ["must be one of", "did you mean 'cosine'"], 14),
    ("missing table", BASE.split("[data]")[0], None, [],
     "data", ["required key 'data' is missing", "add a line"], None),
    ("missing required key", edit(BASE, 'name = "t"', ""), None, [],
     "run.name", ["required key 'name'", 'name = "text"'], 1),
    ("unusable run name", edit(BASE, 'name = "t"', 'name = "my run!"'), None, [],
     "run.name", ["not a usable run name", "letters, digits"], 2),
    ("TOML syntax error", edit(BASE, "lr = 1e-3", "lr = 1e-3 x"), None, [],
     "", ["not valid TOML", "line 13"], 13),
    ("heads not divisible by TP", edit(BASE, "tensor_parallel = 1", "tensor_parallel = 3"), None, [],
     "inference.tensor_parallel", ["4 attention heads", "divides 4"], 19),
    ("KV heads neither split nor replicated evenly",
     edit(GPU_BASE, "tensor_parallel = 1", "tensor_parallel = 7"), None, [],
     "inference.tensor_parallel", ["4 KV heads", "multiple of it"], 18),
    ("TP larger than a node", edit(edit(GPU_BASE, "tensor_parallel = 1", "tensor_parallel = 4"),
                                   "gpus_per_node = 8\nmax_tokens", "gpus_per_node = 2\nmax_tokens"), None, [],
     "inference.tensor_parallel", ["more than the 2 GPUs", "at most 2"], 18),
    ("batch not whole groups", edit(BASE, "global_batch_size = 64", "global_batch_size = 60"), None, [],
     "trainer.global_batch_size", ["not a whole number of groups", "multiple of 8"], 15),
    ("token budget below the longest sequence",
     edit(BASE, "micro_batch_size = 8", "micro_batch_size = 8\nmicro_batch_tokens = 20"), None, [],
     "trainer.micro_batch_tokens", ["below the longest sequence", "24 tokens", "at least 24"], 15),
    ("negative token budget", edit(BASE, "micro_batch_size = 8", "micro_batch_size = 8\nmicro_batch_tokens = -1"),
     None, [], "trainer.micro_batch_tokens", ["zero or more"], 15),
    ("batch not split over micro-batches and ranks",
     edit(edit(BASE, "ranks_per_node = 1", "ranks_per_node = 2"), "global_batch_size = 64", "global_batch_size = 24"),
     None, ["algorithm.group_size=4"],
     "trainer.global_batch_size", ["micro-batches of 8 on each of 2", "multiple of"], 15),
    ("replicas x TP exceed the inference group",
     edit(GPU_BASE, "replicas = 1\ntensor_parallel = 1", "replicas = 4\ntensor_parallel = 4")
     + "\n[groups.inference]\nnodes = 1\n", None, [],
     "inference.replicas", ["4 x 4 = 16 GPUs", "1 nodes x 8 GPUs = 8"], 17),
    ("FSDP sizes do not multiply to the world size",
     edit(BASE, "ranks_per_node = 1", "ranks_per_node = 2\ndp_shard = 3"), None, [],
     "trainer.dp_shard", ["2 ranks", "dp_shard ="], 12),
    ("model directory without config.json", edit(BASE, 'preset = "tiny-llama"', 'path = "no/such/model"'),
     None, [], "model.path", ["config.json does not exist", "make_tiny_model.py"], 5),
    ("missing prompt file", edit(BASE, '"builtin:arithmetic"', '"no/such/prompts.jsonl"'), None, [],
     "data.source", ["does not exist", "JSONL"], 30),
    ("unknown builtin task", edit(BASE, '"builtin:arithmetic"', '"builtin:arithmetc"'), None, [],
     "data.source", ["no builtin task", "did you mean 'builtin:arithmetic'"], 30),
    ("unknown model preset", edit(BASE, '"tiny-llama"', '"tiny-lama"'), None, [],
     "model.preset", ["unknown model preset", "did you mean 'tiny-llama'"], 5),
    ("reward function without module", edit(BASE, '"hpcrl.reward.builtin:exact_match"', '"exact_match"'),
     None, [], "reward.function", ["not of the form 'module:function'"], 24),
    ("misspelt built-in reward", edit(BASE, "builtin:exact_match", "builtin:exact_mach"), None, [],
     "reward.function", ["no function 'exact_mach'", "did you mean 'exact_match'"], 24),
    ("reward module not importable", edit(BASE, '"hpcrl.reward.builtin:exact_match"', '"no_such_mod:score"'),
     None, [], "reward.function", ["cannot be found", "PYTHONPATH"], 24),
    ("unknown component", BASE + "\n[groups.trainers]\ntime = \"01:00:00\"\n", None, [],
     "groups.trainers", ["unknown component", "did you mean [groups.trainer]"], 33),
    ("unknown key in a group (partition misspelt)", BASE + "\n[groups.trainer]\npartion = \"gpu\"\n", None, [],
     "groups.trainer.partion", ["unknown key", "did you mean 'partition'"], 34),
    ("Slurm time not understood", BASE + "\n[groups.trainer]\ntime = \"4h\"\n", None, [],
     "groups.trainer.time", ["not a Slurm time", "04:00:00"], 34),
    ("Slurm memory not understood", BASE + "\n[groups.head]\nmem = \"200GB\"\n", None, [],
     "groups.head.mem", ["not a Slurm memory size", "200G"], 34),
    ("sbatch flag not in long form", BASE + "\n[groups.reward]\nsbatch_extra = [\"-p debug\"]\n", None, [],
     "groups.reward.sbatch_extra", ["not a long sbatch option"], 34),
    ("zero trainer nodes", edit(BASE, "nodes = 1", "nodes = 0"), None, [],
     "trainer.nodes", ["must be at least 1"], 9),
    ("GPUs on a CPU-only cluster profile", GPU_BASE, "local", [],
     "trainer.gpus_per_node", ["no GPUs", "set trainer.gpus_per_node = 0"], 10),
    ("unknown cluster profile", BASE, "nosuchcluster", [],
     "run.cluster", ["no cluster profile 'nosuchcluster'", "generic", "local"], None),
    ("top_p out of range", edit(BASE, "max_tokens = 8", "max_tokens = 8\ntop_p = 1.5"), None, [],
     "inference.top_p", ["must be in (0, 1]"], 22),
    ("group of one", edit(BASE, "group_size = 8", "group_size = 1"), None, [],
     "algorithm.group_size", ["at least 2"], 27),
    ("max_model_len shorter than prompt + completion",
     edit(BASE, "max_tokens = 8", "max_tokens = 8\nmax_model_len = 10"), None, [],
     "inference.max_model_len", ["shorter than max_prompt_tokens + max_tokens = 24"], 22),
    ("betas of the wrong length", edit(BASE, "lr = 1e-3", "lr = 1e-3\nbetas = [0.9]"), None, [],
     "trainer.betas", ["two numbers"], 14),
    ("array for a table", "reward = [1]\n" + BASE.replace('[reward]\nfunction = "hpcrl.reward.builtin:exact_match"\n', ""),
     None, [], "reward", ["expected a table", "[reward]"], 1),
    ("override without a value", BASE, None, ["trainer.lr"],
     "trainer.lr", ["not of the form key.sub=value", "--set trainer.lr=1e-5"], None),
    ("override of the wrong type", BASE, None, ["trainer.nodes=abc"],
     "trainer.nodes", ["expected an integer", "'abc'"], None),
    ("group nodes disagree with the trainer", BASE + "\n[groups.trainer]\nnodes = 2\n", None, [],
     "groups.trainer.nodes", ["but trainer.nodes = 1", "remove groups.trainer.nodes"], 34),
    ("warmup longer than the run", edit(BASE, "steps = 10", "steps = 10\nwarmup_steps = 20"), None, [],
     "trainer.warmup_steps", ["longer than the run"], 13),
    ("bad environment variable name", BASE + "\n[cluster.env]\n\"1BAD\" = \"x\"\n", None, [],
     "cluster.env.1BAD", ["not a valid environment variable name"], 34),
    ("empty file", "", None, [], "run", ["required key 'run' is missing"], None),
    ("negative start timeout", edit(BASE, 'name = "t"', 'name = "t"\nstart_timeout_s = -5'), None, [],
     "run.start_timeout_s", ["must be 0 (derived from the model's size) or more seconds", "remove start_timeout_s"], 3),
    ("NCCL weight transport on CPU groups", edit(BASE, "max_tokens = 8", 'max_tokens = 8\nweight_transport = "nccl"'),
     None, [], "inference.weight_transport",
     ['"nccl" sends from GPU to GPU', "trainer.gpus_per_node = 0", 'set weight_transport = "gloo"'], 22),
    ("relative cluster.python", BASE + '\n[cluster]\npython = "venv/bin/python"\n', None, [],
     "cluster.python", ["'venv/bin/python' is not an absolute path", "absolute path on the compute nodes"], 34),
    # Issue 28: each of these was a traceback, a silently wrong run, or a misleading message.
    ("run directory under a file", BASE, None, ["run.run_dir=/etc/passwd/x"],
     "run.run_dir", ["/etc/passwd/x is under /etc/passwd, which is a file", "set run.run_dir to a directory"], None),
    ("run directory in /proc", BASE, None, ["run.run_dir=/proc/self/x"],
     "run.run_dir", ["/proc/self/x is in /proc, a kernel filesystem"], None),
    ("run directory that is a file", edit(BASE, 'name = "t"', 'name = "t"\nrun_dir = "/etc/passwd"'), None, [],
     "run.run_dir", ["/etc/passwd is a file, not a directory"], 3),
    ("unset variable in the run directory", edit(BASE, 'name = "t"', 'name = "t"\nrun_dir = "$HPCRL_UNSET_28/x"'),
     None, [], "run.run_dir", ["uses $HPCRL_UNSET_28, which is not set", "export HPCRL_UNSET_28"], 3),
    ("unset braced variable in a prompt file", BASE, None, ["data.source=${HPCRL_UNSET_28}/p.jsonl"],
     "data.source", ["uses $HPCRL_UNSET_28, which is not set"], None),
    ("integer beyond 64 bits", edit(BASE, "steps = 10", "steps = 100000000000000000000000"), None, [],
     "trainer.steps", ["does not fit in a 64-bit integer", "steps = 100"], 12),
    ("infinite temperature", edit(BASE, "max_tokens = 8", "max_tokens = 8\ntemperature = inf"), None, [],
     "inference.temperature", ["must be a finite number, got inf", "temperature = 1.0"], 22),
    ("zero temperature", edit(BASE, "max_tokens = 8", "max_tokens = 8\ntemperature = 0.0"), None, [],
     "inference.temperature", ["must be above 0, got 0.0", "greedy"], 22),
    ("top_p not a number", edit(BASE, "max_tokens = 8", "max_tokens = 8\ntop_p = nan"), None, [],
     "inference.top_p", ["must be a finite number, got nan"], 22),
    ("learning rate not a number", BASE, None, ["trainer.lr=nan"],
     "trainer.lr", ["must be a finite number, got nan", "lr = 1e-06"], None),
    ("a float literal beyond range", BASE + "\n[cluster]\ngpu_mem_gib = 1e400\n", None, [],
     "cluster.gpu_mem_gib", ["must be a finite number, got inf"], 34),
    ("a huge integer for a float key", BASE, None, ["inference.kv_cache_gib=" + "9" * 400],
     "inference.kv_cache_gib", ["400-digit number is beyond any float"], None),
    ("negative seed", edit(BASE, 'name = "t"', 'name = "t"\nseed = -1'), None, [],
     "run.seed", ["must be in [0, 2**32), got -1"], 3),
    ("shuffle seed of 2**32", edit(BASE, "max_prompt_tokens = 16", "max_prompt_tokens = 16\nshuffle_seed = 4294967296"),
     None, [], "data.shuffle_seed", ["must be in [0, 2**32)"], 32),
    ("signal delay beyond Slurm's", BASE + "\n[cluster]\nsignal_delay_s = 70000\n", None, [],
     "cluster.signal_delay_s", ["must be 1 to 65535 seconds (Slurm's --signal limit)"], 34),
    ("a heartbeat timeout shorter than a few beats", BASE + "\n[cluster]\nheartbeat_timeout_s = 1\n", None, [],
     "cluster.heartbeat_timeout_s", ["must be at least 3 s (tasks beat every second), got 1"], 34),
    ("key set twice", edit(BASE, "steps = 10", "steps = 10\nsteps = 20"), None, [],
     "trainer.steps", ["is set twice (lines 12 and 13)", "TOML allows each key once"], 13),
    ("table declared twice", BASE + "\n[trainer]\nwarmup_steps = 1\n", None, [],
     "trainer", ["table [trainer] is declared twice (lines 8 and 33)", "merge the two [trainer] tables"], 33),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_broken_config_error_names_file_line_key_and_fix(case, tmp_path: Path, monkeypatch, capsys):
    name, text, cluster, overrides, key, words, line = case
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # launch/ profiles are found from the repo
    path = tmp_path / "broken.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, cluster=cluster, overrides=overrides)
    err = info.value
    message = str(err)
    assert err.key == key, message
    for word in words:
        assert word in message, message
    assert "Fix: " in message and err.fix, message
    if overrides and err.file == "--set":
        assert message.startswith("--set:")
    else:
        assert err.file == str(path), message
        assert err.line == line, message
        expected_where = f"{path}:{line}:" if line else f"{path}:"
        assert message.startswith(expected_where), message
    # The CLI prints the same message on one line and exits 2, never a traceback.
    argv = ["plan", str(path)] + (["--cluster", cluster] if cluster else [])
    for override in overrides:
        argv += ["--set", override]
    assert main(argv) == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("hpcrl: error: ") and "Traceback" not in stderr
    assert message in stderr


def test_there_are_at_least_25_broken_configs():
    assert len(CASES) >= 25


def test_a_missing_config_file_is_reported_by_name(tmp_path: Path):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.toml")
