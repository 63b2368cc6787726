"""Admission: `workers` requests run on the model at once, each on a worker thread (one without a
pool: llama.cpp already uses every core for one batch; one per slot with a pool, whose decodes
meet in one batch, engine.batcher), a bounded number wait behind them, and past that a request is
answered 503 with Retry-After before anything is read into a cache."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .requests import ApiError


class Ticket:
    """A request's place in line: settled once, when its job starts or when it leaves unstarted."""

    def __init__(self):
        self.settled = False


class Admission:
    def __init__(self, queue: int, on_reject: Callable[[], None], workers: int = 1):
        self.queue = queue
        self.on_reject = on_reject
        self.workers = workers
        self.worker = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvlite-model")
        self.active = 0  # requests admitted and not finished: up to `workers` running, the rest waiting
        self._lock = threading.Lock()

    @property
    def waiting(self) -> int:
        return max(self.active - self.workers, 0)

    def enqueue(self) -> Ticket:
        """Admit a request (`workers` running, `queue` waiting), or answer 503 (before a stream starts)."""
        with self._lock:
            if self.active >= self.queue + self.workers:
                self.on_reject()
                raise ApiError(503, "the server is busy: try again shortly", kind="unavailable_error")
            self.active += 1
        return Ticket()

    def _settle(self, ticket: Ticket) -> bool:
        """True the first time: when its job starts, or when its request went away before that."""
        with self._lock:
            if ticket.settled:
                return False
            ticket.settled = True
            return True

    def _leave(self) -> None:
        with self._lock:
            self.active -= 1

    async def run(self, ticket: Ticket, job: Callable[[], Any]) -> Any:
        """job on a worker thread, after the requests admitted before it (None: its request was
        cancelled while it waited)."""

        def start():
            if not self._settle(ticket):
                return None
            try:
                return job()
            finally:
                self._leave()

        try:
            return await asyncio.get_running_loop().run_in_executor(self.worker, start)
        finally:
            if self._settle(ticket):  # never started: it leaves now
                self._leave()

    def close(self) -> None:
        """Wait for the running jobs; the queued ones never start."""
        self.worker.shutdown(wait=True, cancel_futures=True)
