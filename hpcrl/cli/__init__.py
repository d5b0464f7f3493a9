"""The `hpcrl` command line."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from hpcrl.errors import HpcrlError

if TYPE_CHECKING:
    from hpcrl.config.schema import Config


def load_run_config(run_dir: str, *overrides: str) -> Config:
    """The resolved config a run wrote into RUN_DIR (`hpcrl resume`, `hpcrl export`), its run.run_dir set to where
    the directory is now (it may have moved), then `overrides` (KEY=VALUE); an HpcrlError when RUN_DIR is no run's."""
    from hpcrl.config import load_config
    from hpcrl.rundir import CONFIG_FILE

    where = Path(run_dir).absolute()
    if not (where / CONFIG_FILE).is_file():
        raise HpcrlError(f"{where} is not a run directory (no {CONFIG_FILE}); give the directory the run wrote "
                         "(runs/<name> by default)")
    return load_config(where / CONFIG_FILE, overrides=[f"run.run_dir={where}", *overrides])
