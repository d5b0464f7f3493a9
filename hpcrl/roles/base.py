"""What every role shares: one engine thread and the endpoint table."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

Endpoint = tuple[Callable[[Any], Awaitable[Any]], bool]
"""(async fn(call), idempotent)."""


class Role:
    group = ""

    def __init__(self) -> None:
        # One thread: engine calls run one at a time, in arrival order (collectives line up across ranks),
        # and the event loop stays free for heartbeats.
        self._engine_thread = ThreadPoolExecutor(1, thread_name_prefix=f"hpcrl-{self.group}")

    async def on_engine(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._engine_thread, fn, *args)

    def endpoints(self) -> dict[str, Endpoint]:
        raise NotImplementedError

    def close(self) -> None:
        self._engine_thread.shutdown(wait=True, cancel_futures=True)
