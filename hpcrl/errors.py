"""The one error hierarchy of hpcrl.

Every error a user can cause derives from `HpcrlError` and carries a message that says what
was wrong and how to fix it; the CLI prints that message and exits non-zero, never a traceback.
"""

from __future__ import annotations


class HpcrlError(Exception):
    """Root of every error hpcrl raises on purpose."""


class ConfigError(HpcrlError):
    """A run configuration (TOML file, cluster profile or --set override) is wrong.

    Carries where (file and line when known), which dotted key, what is wrong and the fix.
    """

    def __init__(self, *, key: str, problem: str, fix: str, file: str | None = None,
                 line: int | None = None) -> None:
        self.key = key
        self.problem = problem
        self.fix = fix
        self.file = file
        self.line = line
        super().__init__(self._format())

    def _format(self) -> str:
        where = self.file or "<config>"
        if self.line is not None:
            where += f":{self.line}"
        key = f" {self.key}:" if self.key else ""
        return f"{where}:{key} {self.problem}. Fix: {self.fix}"

    def located(self, *, file: str | None, line: int | None) -> ConfigError:
        """Return the same error, placed in `file` at `line` (keeps an existing location)."""
        return ConfigError(key=self.key, problem=self.problem, fix=self.fix,
                           file=self.file or file, line=self.line if self.line is not None else line)


class PlanError(HpcrlError):
    """A resource or transfer plan cannot be made from a valid-looking configuration."""


class SlurmError(HpcrlError):
    """Slurm refused or failed something we asked of it (sbatch, squeue, scancel)."""


class TrainerError(HpcrlError):
    """The trainer engine cannot build, load or step the model (names the rank and parameter)."""


class TransferError(HpcrlError):
    """A weight transfer failed: bad plan or digest, missing or mis-shaped tensor, peer gone, timeout.

    The message names the parameter and the trainer / inference ranks it concerns.
    """
