"""The run directory keeps a resolved config that loads back to the same Config."""

from __future__ import annotations

from pathlib import Path

from hpcrl.config import load_config
from hpcrl.config.dump import dump_toml
from hpcrl.launch.rundir import CONFIG_FILE, LAUNCH_FILE, prepare_run_dir, read_json

REPO = Path(__file__).resolve().parents[2]


def test_the_resolved_config_copy_loads_back_to_an_equal_config(tmp_path: Path):
    for name in ("tiny_grpo", "llama70b_grpo"):
        config = load_config(REPO / "configs" / f"{name}.toml", cluster=str(REPO / "launch" / "generic.toml"),
                             overrides=["trainer.lr=2e-6"])
        copy = tmp_path / f"{name}.toml"
        copy.write_text(dump_toml(config))
        assert load_config(copy) == config


def test_prepare_run_dir_writes_config_launch_and_one_log_folder_per_group(tmp_path: Path):
    prepare_run_dir(tmp_path / "run", config_toml="x = 1\n", launch={"groups": []}, groups=["head", "trainer"])
    assert (tmp_path / "run" / CONFIG_FILE).read_text() == "x = 1\n"
    assert read_json(tmp_path / "run" / LAUNCH_FILE) == {"groups": []}
    assert sorted(p.name for p in (tmp_path / "run" / "logs").iterdir()) == ["head", "trainer"]
    assert not list((tmp_path / "run").glob(".*tmp*"))
