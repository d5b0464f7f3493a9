"""Rendered batch scripts are pinned by golden files in sbatch/golden/ (and the templates in sbatch/).

Regenerate after an intended change with:  HPCRL_UPDATE_GOLDEN=1 pytest tests/slurm/test_render.py
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

from hpcrl.config import load_config
from hpcrl.errors import ConfigError
from hpcrl.slurm.render import render_template
from hpcrl.slurm.spec import job_spec

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "sbatch" / "golden"
UPDATE = os.environ.get("HPCRL_UPDATE_GOLDEN") == "1"
CONFIGS = sorted(p.stem for p in (REPO / "configs").glob("*.toml"))
PROFILES = sorted(p.stem for p in (REPO / "launch").glob("*.toml"))


def _config(name: str, profile: str, layout: str):
    return load_config(REPO / "configs" / f"{name}.toml", cluster=str(REPO / "launch" / f"{profile}.toml"),
                       overrides=[f"run.run_dir=/runs/{name}", f'cluster.layout="{layout}"'])


def _script(config) -> str:
    from hpcrl.slurm.executor import HetJobExecutor
    executor = HetJobExecutor(f"{config.run_dir}/submitit", spec=job_spec(config), run_dir=config.run_dir,
                              python="python3")
    return executor.script_text()


@functools.cache
def _renderable() -> dict[str, object]:
    """Every (config, profile, layout) that is valid, by golden file name."""
    found = {}
    for name in CONFIGS:
        for profile in PROFILES:
            for layout in ("hetjob", "split"):
                try:
                    config = _config(name, profile, layout)
                    job_spec(config)
                except ConfigError:
                    continue
                found[f"{name}__{profile}__{layout}.sbatch"] = config
    return found


def _compare(path: Path, text: str) -> None:
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"{path} is missing: run HPCRL_UPDATE_GOLDEN=1 pytest {__file__}"
    assert text == path.read_text(), f"{path.name} changed: review the diff, then regenerate with HPCRL_UPDATE_GOLDEN=1"


@pytest.mark.parametrize("golden", sorted(_renderable()))
def test_rendered_script_matches_its_golden_file(golden: str):
    _compare(GOLDEN / golden, _script(_renderable()[golden]))


def test_every_golden_file_belongs_to_a_valid_config_and_profile():
    assert sorted(p.name for p in GOLDEN.glob("*.sbatch")) == sorted(_renderable())


def test_goldens_cover_both_layouts_and_both_shipped_profiles():
    names = _renderable()
    assert {n.split("__")[1] for n in names} == set(PROFILES)
    assert any(n.endswith("__hetjob.sbatch") for n in names) and any(n.endswith("__split.sbatch") for n in names)


@pytest.mark.parametrize("layout", ["hetjob", "split"])
def test_hand_usable_templates_are_the_tiny_config_on_the_local_profile(layout: str):
    _compare(REPO / "sbatch" / f"{layout}.sbatch", render_template(job_spec(_config("tiny_grpo", "local", layout))))


def test_a_hetjob_script_has_one_block_per_component_separated_by_hetjob_lines():
    text = _script(_config("llama70b_grpo", "generic", "hetjob"))
    blocks = text.split("#SBATCH hetjob\n")
    assert len(blocks) == 4
    assert [b.split("# component ")[-1].split("\n")[0] for b in blocks] == [
        "0: head", "1: trainer", "2: inference", "3: reward"]
    assert "#SBATCH --partition=cpu" in blocks[0] and "#SBATCH --gpus-per-node=8" in blocks[1]
    assert text.count("--job-name") == 1  # job-wide options only in the first block


def test_rendering_is_pure_and_repeatable():
    config = _config("tiny_grpo", "local", "hetjob")
    assert _script(config) == _script(config)


def test_any_subset_of_components_renders_in_het_group_order():
    config = load_config(REPO / "configs" / "tiny_grpo.toml", cluster=str(REPO / "launch" / "local.toml"),
                         overrides=["run.run_dir=/runs/x", "reward.tasks=0"])
    spec = job_spec(config)
    assert [g.name for g in spec.groups] == ["head", "trainer", "inference"]
    assert _script(config).count("#SBATCH hetjob") == 2


def test_a_spec_whose_sbatch_option_holds_a_newline_is_refused_by_the_renderer_naming_the_option():
    """The config refuses such values at load (tests/config/test_hostile_values.py); a JobSpec made another way
    meets the same check where the script is written (issue 38, U3)."""
    import dataclasses

    spec = job_spec(_config("tiny_grpo", "local", "hetjob"))
    block = spec.blocks[1]
    hostile = dataclasses.replace(block, options=(*block.options, ("partition", "gpu\ntouch /tmp/pwned")))
    bad = dataclasses.replace(spec, blocks=(spec.blocks[0], hostile, *spec.blocks[2:]))
    with pytest.raises(ConfigError, match=r"#SBATCH --partition: holds the control character '\\n' at character 3"):
        render_template(bad)
    assert "touch" not in render_template(spec)


def test_a_split_job_with_a_spare_node_renders_one_more_node_and_no_kill():
    """Its own golden file (sbatch/golden/spare/): the shipped configs' goldens hold no spare (spare_nodes = 0)."""
    config = load_config(REPO / "configs" / "tiny_grpo.toml", cluster=str(REPO / "launch" / "local.toml"),
                         overrides=["run.run_dir=/runs/tiny_grpo", 'cluster.layout="split"', "cluster.spare_nodes=1",
                                    "inference.replicas=2"])
    text = _script(config)
    _compare(GOLDEN / "spare" / "tiny_grpo__local__split__spare1.sbatch", text)
    assert "#SBATCH --nodes=5\n" in text and "#SBATCH --no-kill\n" in text
