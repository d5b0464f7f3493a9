"""setup_logging: what reaches the terminal and what the log file keeps, vLLM's processes included.

The logging of this test process is put back after each test (tests/conftest.py); the cases that
need a process of their own (a vLLM child, a task whose output is its log) start one.
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from hpcrl.logs import PROGRESS, setup_logging

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(30)


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def log_some_of_everything() -> None:
    logging.getLogger("hpcrl.rl.loop").info("checkpoint runs/x/checkpoints/step_50")
    logging.getLogger("hpcrl.rl.loop").debug("a detail")
    logging.getLogger(PROGRESS).info("step    1/200  reward 0.000")
    logging.getLogger("vllm.v1.engine.core").info("Successfully reset prefix cache")
    logging.getLogger("vllm.v1.engine.core").warning("the KV cache is too small")
    logging.getLogger("vllm.config.vllm").warning("Enforce eager set, disabling torch.compile")
    logging.getLogger("some_library").info("a library's chatter")
    logging.getLogger("hpcrl.rl.ports").warning("generate on inference/1/0 lost")
    logging.getLogger("vllm.v1.engine.core").error("EngineCore failed to start")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("`torch.distributed.reduce_op` is deprecated", FutureWarning, stacklevel=1)


def test_the_terminal_shows_hpcrl_and_other_libraries_errors_while_the_file_keeps_everything_at_info(
        tmp_path, capsys):
    log_file = setup_logging(tmp_path, "run", 0, verbose=False)
    log_some_of_everything()
    terminal = capsys.readouterr().err.splitlines()
    assert terminal == ["checkpoint runs/x/checkpoints/step_50", "step    1/200  reward 0.000",
                        "WARNING: generate on inference/1/0 lost",
                        "ERROR vllm.v1.engine.core: EngineCore failed to start"]
    assert log_file == tmp_path / "logs" / "run" / "rank0.log"
    kept = log_file.read_text()
    for line in ("run: checkpoint runs/x/checkpoints/step_50", "run: step    1/200  reward 0.000",
                 "run: INFO vllm.v1.engine.core (MainProcess pid", "Successfully reset prefix cache",
                 "run: WARNING vllm.v1.engine.core", "the KV cache is too small",
                 "run: WARNING vllm.config.vllm", "Enforce eager set", "run: INFO some_library",
                 "run: generate on inference/1/0 lost", "run: WARNING py.warnings (MainProcess pid",
                 "FutureWarning: `torch.distributed.reduce_op` is deprecated"):
        assert line in kept, kept
    assert "a detail" not in kept


def test_verbose_shows_every_library_at_info_on_the_terminal_and_hpcrl_at_debug_everywhere(tmp_path, capsys):
    log_file = setup_logging(tmp_path, "run", 0, verbose=True)
    log_some_of_everything()
    terminal = capsys.readouterr().err
    assert "INFO vllm.v1.engine.core: Successfully reset prefix cache" in terminal
    assert "WARNING vllm.config.vllm: Enforce eager set" in terminal
    assert "WARNING py.warnings: " in terminal and "FutureWarning: `torch.distributed.reduce_op`" in terminal
    assert "a detail" in terminal and "a detail" in log_file.read_text()


def test_without_a_run_directory_there_is_no_file_and_other_libraries_warnings_reach_the_terminal(
        tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH", raising=False)
    assert setup_logging(None, "hpcrl", 0) is None
    logging.getLogger("hpcrl.cli").info("submitted")
    logging.getLogger("some_library").info("a library's chatter")
    logging.getLogger("some_library").warning("a library's warning")
    assert capsys.readouterr().err == "submitted\nWARNING some_library: a library's warning\n"
    assert "VLLM_LOGGING_CONFIG_PATH" not in os.environ


def test_stderr_to_log_sends_what_this_process_and_its_children_write_to_fd_2_to_the_log_but_not_python_errors(
        tmp_path):
    """What vLLM's EngineCore prints before it configures its logging, torch's C++ warnings: fd 2, inherited."""
    task = ("import logging, os, subprocess, sys, warnings; from hpcrl.logs import setup_logging, stderr_to_log; "
            f"log_file = setup_logging({str(tmp_path)!r}, 'run', 0, stream='stdout'); stderr_to_log(log_file); "
            "os.write(2, b'[W utils.cpp:68] Warning: NUMA binding\\n'); "
            "subprocess.run([sys.executable, '-c', 'import sys; print(\"Triton is installed\", file=sys.stderr)']); "
            "warnings.warn('reduce_op is deprecated', FutureWarning); "
            "logging.getLogger('hpcrl.rl.loop').info('done in 1 s'); "
            "raise SystemExit('hpcrl: error: a traceback or error of this process')")
    done = subprocess.run([sys.executable, "-c", task], capture_output=True, text=True, timeout=20,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 1
    assert (done.stdout, done.stderr) == ("done in 1 s\n", "hpcrl: error: a traceback or error of this process\n")
    kept = (tmp_path / "logs" / "run" / "rank0.log").read_text().splitlines()
    assert "[W utils.cpp:68] Warning: NUMA binding" in kept and "Triton is installed" in kept, kept
    assert any(" run: WARNING py.warnings (MainProcess pid " in line for line in kept), kept
    assert kept[-1].endswith(" run: done in 1 s")


def test_on_a_terminal_the_progress_line_rewrites_itself_and_other_lines_go_above_it(tmp_path, monkeypatch):
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    setup_logging(tmp_path, "run", 0, stream="stdout")
    progress, log = logging.getLogger(PROGRESS), logging.getLogger("hpcrl.rl.loop")
    progress.info("step 1", extra={"keep": True})
    progress.info("step 2")
    progress.info("step 3")
    log.info("checkpoint 3")
    progress.info("step 4", extra={"keep": True})
    clear = "\r\x1b[2K"
    assert terminal.getvalue() == ("step 1\n" + clear + "step 2" + clear + "step 3"
                                   + clear + "checkpoint 3\nstep 3" + clear + "step 4\n")
    assert "step 2" in (tmp_path / "logs" / "run" / "rank0.log").read_text()  # the file has every step


def test_vllm_processes_apply_the_same_configuration_from_the_file_its_environment_names(tmp_path):
    """As vLLM's EngineCore and workers do (vllm/logger.py): dictConfig of VLLM_LOGGING_CONFIG_PATH."""
    log_file = setup_logging(tmp_path, "inference", 2)
    config_path = Path(os.environ["VLLM_LOGGING_CONFIG_PATH"])
    assert config_path == tmp_path / "logs" / "inference" / "rank2.logging.json"
    assert os.environ["VLLM_CONFIGURE_LOGGING"] == "1"
    child = ("import json, logging.config, os; "
             "logging.config.dictConfig(json.load(open(os.environ['VLLM_LOGGING_CONFIG_PATH']))); "
             "logging.getLogger('vllm.v1.engine.core').info('Initializing a V1 LLM engine'); "
             "logging.getLogger('vllm.v1.worker').warning('worker warning')")
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=20,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == ""
    kept = log_file.read_text()
    assert "inference: INFO vllm.v1.engine.core (MainProcess pid" in kept and "Initializing a V1 LLM engine" in kept
    assert "inference: WARNING vllm.v1.worker (MainProcess pid" in kept and "worker warning" in kept
    assert json.loads(config_path.read_text())["loggers"]["vllm"] == {"level": "INFO", "handlers": [],
                                                                      "propagate": True}


def test_a_task_whose_output_already_is_its_log_writes_each_record_there_once(tmp_path):
    """A group task: srun --output (or the local executor) makes stdout and stderr its log file."""
    log_file = tmp_path / "logs" / "trainer" / "rank1.log"
    log_file.parent.mkdir(parents=True)
    task = ("import logging, sys; from hpcrl.logs import setup_logging; "
            f"setup_logging({str(tmp_path)!r}, 'trainer', 1); "
            "logging.getLogger('hpcrl.roles.serve').info('trainer rank 1: registered'); "
            "logging.getLogger('vllm.x').info('an engine line')")
    with open(log_file, "ab") as out:
        done = subprocess.run([sys.executable, "-c", task], stdout=out, stderr=subprocess.STDOUT, timeout=20,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0
    lines = log_file.read_text().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].endswith(" trainer: trainer rank 1: registered")
    assert " trainer: INFO vllm.x (MainProcess pid " in lines[1] and lines[1].endswith("an engine line")
