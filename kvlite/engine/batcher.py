"""Continuous batching on a pool's context (docs/serve.md). Each conversation runs on a thread of its
own and decodes as if it were alone (Context.decode); the decodes that are waiting at the same
moment go to llama.cpp as one batch, and every conversation's next token rides in the same step
as another's prefill chunk.

The schedule: first come, first served, by turn. A step takes the waiting decodes in the order
their turns began (Batcher.turn; a decode outside a turn: when it was asked) while they fit in the
batch (n_batch: a prefill chunk plus one token per lane). So the oldest turn's prompt is read one
chunk a step at full speed while every generating conversation's next token goes along with it,
and a newer turn's prompt waits for the older prompts, as in a queue, but not for their replies.
No turn waits on a newer one, so none starves. Before it runs, a step waits up to WAIT_S for the
lanes of the step before to be back (each samples its token between steps), so a step carries
every generating conversation, not whichever came first. Everything else done on the context (sequence
operations, state export and import) is one call at a time under the context's lock, between
steps."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import llama_cpp as L
import numpy as np

from ..errors import KvliteError
from ..native import native

WAIT_S = 0.003  # a decode step of SmolLM2 on 2 cores takes 10-30 ms; sampling a token well under 1


def decode_failed(rc: int, position: int) -> KvliteError:
    """What a llama_decode that returned rc says, at the first position of its batch."""
    reason = {1: "no free cell in the KV cache (context full)", 2: "aborted"}.get(rc, "error")
    return KvliteError(f"llama_decode failed ({rc}: {reason}) at position {position}")


def fill_batch(b, at: int, tokens: Sequence[int], positions: Sequence[int], seq_id: int, logits: str) -> int:
    """Write tokens on one sequence into llama_batch b from row `at` on; logits: "all", "last" or
    "none", the rows llama.cpp keeps logits for. Returns the row after them."""
    n = len(tokens)
    for k in range(n):
        b.token[at + k] = tokens[k]
        b.pos[at + k] = positions[k]
        b.n_seq_id[at + k] = 1
        b.seq_id[at + k][0] = seq_id
        b.logits[at + k] = logits == "all" or (logits == "last" and k == n - 1)
    return at + n


@dataclasses.dataclass
class Job:
    """One thread's decode of at most n_batch tokens on one sequence, or a call to run alone on the
    batcher's thread (a native kernel: Native.executor)."""

    tokens: Sequence[int] = ()
    positions: Sequence[int] = ()
    seq_id: int = -2
    logits: str = "none"  # "last", "all" or "none"
    rows: np.ndarray | None = None  # the logits it asked for, [k, n_vocab]
    error: BaseException | None = None
    done: bool = False
    call: Callable[[], Any] | None = None
    result: Any = None
    at: float = dataclasses.field(default_factory=time.monotonic)  # when it was asked

    @property
    def lane(self) -> int:
        return self.seq_id // 2  # context.lane_seqs' inverse


class Batcher:
    """The steps run on a thread of their own, and so do the native kernels while it lives
    (Native.executor): with ggml's CPU backend built with OpenMP each thread that computes a ggml
    graph gets a team of workers of its own, and two teams on the same cores slowed every decode
    (a step of 3 tokens led by whichever thread came first took 56 ms where one took 15; a decode
    after one kernel call on another thread took 36 ms where it took 14)."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.cond = threading.Condition()
        self.queue: list[Job] = []
        self.last_lanes: set[int] = set()
        self.steps = 0  # llama_decode calls made
        self.jobs = 0  # decodes they carried (jobs / steps: the mean batch)
        self.thread: threading.Thread | None = None
        self.closed = False
        self.turns: dict[int, float] = {}  # lane -> when the turn it runs began (Batcher.turn)
        native().executor = self.call  # the kernels of its evictions run on its thread too

    @contextlib.contextmanager
    def turn(self, lane: int) -> Iterator[None]:
        """The lane's decodes for a while (a request's turn) rank by when it began, not each by
        when it was asked: an older turn's prefill goes before a newer one's."""
        self.turns[lane] = time.monotonic()
        try:
            yield
        finally:
            self.turns.pop(lane, None)

    def decode(self, job: Job) -> np.ndarray | None:
        """Run the job in the next step it fits; returns its logits rows (None for "none")."""
        self._wait(job)
        return job.rows

    def call(self, fn: Callable[[], Any]) -> Any:
        """fn() on the batcher's thread, between steps, in its turn."""
        if threading.current_thread() is self.thread:
            return fn()
        job = Job(call=fn)
        self._wait(job)
        return job.result

    def _wait(self, job: Job) -> None:
        with self.cond:
            if self.closed:
                raise KvliteError("the pool is closed")
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="kvlite-batcher", daemon=True)
                self.thread.start()
            self.queue.append(job)
            self.cond.notify_all()
            while not job.done:
                self.cond.wait()
        if job.error:
            raise job.error

    def close(self) -> None:
        """End the thread once the step it runs is over (the jobs still waiting fail)."""
        if native().executor == self.call:
            native().executor = None
        with self.cond:
            self.closed = True
            for j in self.queue:
                j.error, j.done = KvliteError("the pool is closed"), True
            self.queue = []
            self.cond.notify_all()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.closed:
                    self.cond.wait()
                if self.closed:
                    return
                if self.queue[0].call is not None:
                    batch = [self.queue.pop(0)]
                else:
                    deadline = time.perf_counter() + WAIT_S
                    while not self.last_lanes <= {j.lane for j in self.queue} and time.perf_counter() < deadline:
                        self.cond.wait(deadline - time.perf_counter())
                    batch = self.pick(self.queue, self.ctx.n_batch)
                    for j in batch:
                        self.queue.remove(j)
            if batch[0].call is not None:
                try:
                    batch[0].result = batch[0].call()
                except BaseException as e:  # noqa: BLE001 - its thread raises it
                    batch[0].error = e
                with self.cond:
                    batch[0].done = True
                    self.cond.notify_all()
                continue
            try:
                self._step(batch)
            except BaseException as e:  # noqa: BLE001 - each job's thread raises it
                for j in batch:
                    if j.error is None and j.rows is None:
                        j.error = e if isinstance(e, KvliteError) else KvliteError(f"a decode step failed: {e}")
            with self.cond:
                for j in batch:
                    j.done = True
                self.last_lanes = {j.lane for j in batch}
                self.cond.notify_all()

    def pick(self, queue: Sequence[Job], n_batch: int) -> list[Job]:
        """The decodes of the next step: the waiting ones by when their turn began (a decode outside
        a turn: when it was asked), each that still fits in n_batch tokens."""
        batch, n = [], 0
        for j in sorted(queue, key=lambda j: self.turns.get(j.lane, j.at)):
            if j.call is None and n + len(j.tokens) <= n_batch:
                batch.append(j)
                n += len(j.tokens)
        return batch

    def _step(self, batch: list[Job]) -> None:
        """One llama_decode for the jobs (each alone, should the batch not find its cells)."""
        ctx = self.ctx
        b = ctx._batch
        i = 0
        for j in batch:
            i = fill_batch(b, i, j.tokens, j.positions, j.seq_id, j.logits)
        b.n_tokens = i
        capture = ctx.capture
        with ctx.lock:
            if capture is not None:
                capture.enabled = any(capture.lane_on(j.lane) for j in batch)
            rc = L.llama_decode(ctx.ptr, b)
            if rc == 0:
                self.steps += 1
                self.jobs += len(batch)
                start = 0
                for j in batch:
                    n = len(j.tokens)
                    first = {"all": start, "last": start + n - 1}.get(j.logits)
                    if first is not None:
                        j.rows = np.stack([ctx.logits_row(r) for r in range(first, start + n)])
                    start += n
                if capture is not None:
                    capture.deal([(j.lane, len(j.tokens)) for j in batch])
                return
            if capture is not None:
                capture.clear()  # whatever a failed step recorded
        if len(batch) > 1:  # llama.cpp places a batch whole or not at all: find out whose it was
            for j in batch:
                self._step([j])
            return
        batch[0].error = decode_failed(rc, batch[0].positions[0])
