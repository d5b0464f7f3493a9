"""Which modules a piece of code imports, asked of a fresh interpreter (this one has imported everything)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def modules_imported_by(code: str, modules: tuple[str, ...], *, timeout_s: float = 60) -> list[str]:
    """Those of `modules` that are imported after running `code` in a new interpreter at the repository root."""
    probe = f"{code}\nimport json as _j, sys as _s; print(_j.dumps([m for m in {list(modules)!r} if m in _s.modules]))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
