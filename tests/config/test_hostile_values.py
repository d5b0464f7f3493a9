"""Values that passed `hpcrl plan` and broke the run later (issue 38: C3, U3, U4): each is refused at load
with the dotted key, the allowed range or what is wrong, and the fix; the CLI prints it without a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_broken_configs import BASE

from hpcrl.cli.main import main
from hpcrl.config import load_config
from hpcrl.errors import ConfigError

# (--set override, the key named, words of the message)
TIMEOUTS = [
    ("reward.timeout_s=1e9", "reward.timeout_s", "must be at most 86,400, got 1000000000.0"),
    ("env.step_timeout_s=1e9", "env.step_timeout_s", "must be at most 86,400, got 1000000000.0"),
    ("run.start_timeout_s=1e12", "run.start_timeout_s", "must be at most 86,400 s (a day)"),
    ("run.rejoin_timeout_s=1e12", "run.rejoin_timeout_s", "must be at most 86,400 s (a day)"),
    ("cluster.heartbeat_timeout_s=1e10", "cluster.heartbeat_timeout_s", "must be at most 86,400 s (a day)"),
]

# A string bound for job.sbatch, written in TOML with an escaped control character.
SBATCH_STRINGS = [
    ('[cluster]\npartition = "gpu\\nrm -rf ~"', "cluster.partition", "'\\n' at character 3"),
    ('[cluster]\naccount = "proj\\r"', "cluster.account", "'\\r' at character 4"),
    ('[cluster]\nqos = "high\\u0000"', "cluster.qos", "'\\x00' at character 4"),
    ('[cluster]\nname = "c\\nx"', "cluster.name", "'\\n' at character 1"),
    ('[cluster]\nmodules = ["cuda", "nccl\\necho pwned"]', "cluster.modules[1]", "'\\n' at character 4"),
    ('[cluster]\npython = "/usr/bin/python3\\n"', "cluster.python", "'\\n' at character 16"),
    ('[cluster.env]\nNCCL_DEBUG = "INFO\\u001b"', "cluster.env.NCCL_DEBUG", "'\\x1b' at character 4"),
    ('[groups.trainer]\nconstraint = "h100\\nid"', "groups.trainer.constraint", "'\\n' at character 4"),
    ('[groups.trainer]\npartition = "a\\tb"', "groups.trainer.partition", "'\\t' at character 1"),
    ('[groups.inference]\naccount = "a\\nb"', "groups.inference.account", "'\\n' at character 1"),
    ('[groups.reward]\nqos = "a\\u007f"', "groups.reward.qos", "'\\x7f' at character 1"),
    ('[groups.trainer]\nsbatch_extra = ["--exclusive", "--comment=x\\nid"]', "groups.trainer.sbatch_extra[1]",
     "'\\n' at character 11"),
    ('[groups.head]\nmem = "200G\\n"', "groups.head.mem", "'200G\\n' is not a Slurm memory size"),
    ('[groups.head]\ntime = "04:00:00\\n"', "groups.head.time", "is not a Slurm time"),
]

# U4 and the other keys that had no upper bound.
BOUNDS = [
    ("inference.temperature=1e300", "inference.temperature",
     "must be at most 10: above it the sampling is all but uniform, got 1e+300", "(0, 10]"),
    ("eval.n=1000000000", "eval.n", "must be at most 1,024, got 1000000000", "0 to 1,024"),
    ("eval.temperature=50.0", "eval.temperature", "must be at most 10", "(0, 10]"),
    ("algorithm.clip_eps_high=0.1", "algorithm.clip_eps_high",
     "is 0.1, below clip_eps_low = 0.2", "at least 0.2"),
    ("algorithm.group_size=100000", "algorithm.group_size", "must be at most 1,024", "2 to 1,024"),
    ("inference.max_tokens=1000000000", "inference.max_tokens", "must be at most 16,777,216", "1 to 16,777,216"),
    ("inference.kv_cache_gib=1e9", "inference.kv_cache_gib", "must be at most 4,096", "0 to 4,096"),
    ("data.max_prompt_tokens=1000000000", "data.max_prompt_tokens", "must be at most 16,777,216", "1 to"),
    ("data.eval_size=1000000000", "data.eval_size", "must be at most 1,000,000", "0 to 1,000,000"),
    ("trainer.weight_decay=5.0", "trainer.weight_decay", "must be at most 1", "0 to 1"),
    ("trainer.grad_clip=1e300", "trainer.grad_clip", "must be at most 1e+06", "0 to 1e+06"),
    ("trainer.global_batch_size=10000000000", "trainer.global_batch_size", "must be at most 16,777,216", "1 to"),
    ("reward.workers=100000", "reward.workers", "must be at most 1,024", "1 to 1,024"),
    ("env.max_turns=100000", "env.max_turns", "must be at most 1,024", "1 to 1,024"),
    ("cluster.gpus_per_node=1000", "cluster.gpus_per_node", "must be at most 64", "-1 (unknown) or 0 to 64"),
    ("cluster.max_requeues=1000000", "cluster.max_requeues", "must be at most 1,000", "0 to 1,000"),
    ("inference.top_k=1000000000", "inference.top_k", "must be -1 or 1 to 16,777,216", "top_k = -1"),
]


def _refused(path: Path, overrides: list[str], key: str, words: str, capsys) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides=overrides)
    message = str(info.value)
    assert info.value.key == key, message
    assert words in message and "Fix: " in message, message
    argv = ["plan", str(path)] + [a for o in overrides for a in ("--set", o)]
    assert main(argv) == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("hpcrl: error: ") and "Traceback" not in stderr and message in stderr, stderr
    return message


@pytest.mark.parametrize(("override", "key", "words"), TIMEOUTS, ids=[t[1] for t in TIMEOUTS])
def test_a_timeout_beyond_a_day_is_refused_at_load_naming_the_key_and_the_range(
        override, key, words, tmp_path: Path, capsys, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    path = tmp_path / "t.toml"
    path.write_text(BASE)
    message = _refused(path, [override], key, words, capsys)
    assert "86,400 seconds" in message or "(0, 86,400]" in message, message
    load_config(path, overrides=[override.replace("1e9", "86400").replace("1e12", "86400").replace("1e10", "86400")])


@pytest.mark.parametrize(("table", "key", "words"), SBATCH_STRINGS, ids=[s[1] for s in SBATCH_STRINGS])
def test_a_control_character_in_a_string_bound_for_job_sbatch_is_refused_naming_the_key(
        table, key, words, tmp_path: Path, capsys, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    path = tmp_path / "s.toml"
    path.write_text(BASE + "\n" + table + "\n")
    message = _refused(path, [], key, words, capsys)
    if "memory size" not in message and "Slurm time" not in message:
        assert "in job.sbatch it would end the line and run the rest as a shell command" in message
    mended = table.replace("\\n", "").replace("\\r", "").replace("\\t", "").replace("\\u0000", "")
    path.write_text(BASE + "\n" + mended.replace("\\u001b", "").replace("\\u007f", "") + "\n")
    load_config(path)  # the same value on one line loads


@pytest.mark.parametrize(("override", "key", "words", "allowed"), BOUNDS, ids=[b[1] for b in BOUNDS])
def test_a_value_beyond_what_a_run_can_use_is_refused_naming_the_key_and_the_range(
        override, key, words, allowed, tmp_path: Path, capsys, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    path = tmp_path / "b.toml"
    path.write_text(BASE)
    message = _refused(path, [override], key, words, capsys)
    assert allowed in message, message


def test_a_lone_surrogate_from_a_command_line_in_another_encoding_is_refused_naming_the_key(tmp_path: Path,
                                                                                           capsys, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    path = tmp_path / "u.toml"
    path.write_text(BASE)
    # Python reads argv bytes that are not UTF-8 (b"\xff") as surrogates: "\udcff"
    message = _refused(path, ["data.system_prompt=caf\udcff"], "data.system_prompt", "holds a lone surrogate (U+DCFF",
                       capsys)
    assert "write the value in UTF-8" in message


@pytest.mark.parametrize(("override", "key", "words"), [
    ("data.chat_template_kwargs=3", "data.chat_template_kwargs", "expected a table, got 3"),
    ("data.chat_template_kwargs.mode.deep=1", "data.chat_template_kwargs.mode",
     "expected a string or an integer or a number or true or false, got {...} (a table)"),
    ("data.chat_template_kwargs.mode=[1, 2]", "data.chat_template_kwargs.mode", "got [1, 2] (an array)"),
], ids=["not-a-table", "a-table-in-it", "an-array-in-it"])
def test_chat_template_kwargs_that_are_not_a_table_of_simple_values_are_refused_naming_the_key(
        override, key, words, tmp_path: Path, capsys, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    path = tmp_path / "k.toml"
    path.write_text(BASE)
    _refused(path, [override], key, words, capsys)
    assert load_config(path, overrides=["data.chat_template_kwargs.enable_thinking=false",
                                        "data.chat_template_kwargs.depth=2"]).data.chat_template_kwargs == {
        "enable_thinking": False, "depth": 2}
