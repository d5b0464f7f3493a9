"""Worker processes of the tests, forked from one server that imported torch and vLLM once.

A spawned process that imports torch (and vLLM's distributed helpers) spends 8-11 s doing so on 2
cores, and the transfer and trainer tests start a few hundred of them. multiprocessing's forkserver
imports PRELOAD once, in a fresh single-threaded interpreter, and forks every worker from it (0.06 s):
as with spawn, nothing of the test's process (threads, sockets, loggers) is in the worker.

A worker gets the test process's sys.path and working directory at its start (multiprocessing sends
them), but the server's environment: `process` and `start_ranks` send the test process's os.environ
along and set it before the target runs, as a spawned process would have inherited it. Modules whose
import reads the environment (triton's kernels read TRITON_INTERPRET when defined) are not preloaded.

    ctx = forked.context()                     # for its Queue
    worker = forked.process(procs.trainer, spec, rank, store, results)
    procs_ = forked.start_ranks(fn, args=(...), nprocs=3)   # torch.multiprocessing.start_processes
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
from collections.abc import Callable
from typing import Any

PRELOAD = ["torch", "torch.distributed", "vllm.distributed.utils"]


def context() -> Any:
    """The forkserver context; its server (started by the first worker) preloads PRELOAD."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def in_env(env: dict[str, str], target: Callable[..., Any], *args: Any) -> Any:
    """Run `target(*args)` with `env` as the whole environment (in the worker)."""
    os.environ.clear()
    os.environ.update(env)
    return target(*args)


def process(target: Callable[..., Any], *args: Any) -> Any:
    """A worker (not yet started) running `target(*args)` in this process's current environment."""
    return context().Process(target=in_env, args=(dict(os.environ), target, *args))


def start_ranks(fn: Callable[..., Any], *, args: tuple, nprocs: int) -> Any:
    """torch.multiprocessing.start_processes(fn, args, nprocs, join=False), forked: fn(rank, *args)."""
    import torch.multiprocessing as tmp

    context()  # sets the preload before the server starts
    return tmp.start_processes(functools.partial(in_env, dict(os.environ), fn), args=args, nprocs=nprocs,
                               join=False, start_method="forkserver")
