"""A pool's cells and who holds them (`kvlite serve --kv-cells`): a turn reserves the most cells it
may take, the conversations that are idle are parked in host memory, and a turn that does not fit
beside the running ones waits for them. Without a pool only the slots' hold is kept here."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from ..engine import Pool
from .metrics import Metrics
from .slots import Slot, Slots


class Room:
    def __init__(self, slots: Slots, metrics: Metrics):
        self.slots, self.metrics = slots, metrics
        self.pool: Pool | None = None  # set once the model is loaded (Server.load)
        # Taken to choose a slot, hold it, and give a turn its room in the pool; waited on for either
        self.lock = threading.Condition()
        self.reserved: dict[object, int] = {}  # slot id (or a completion's key) -> the cells it may hold at most

    @staticmethod
    def need(slot: Slot, new_tokens: int, n_predict: int) -> int:
        """The most cells the slot's turn may hold: what the conversation holds, its new tokens, the
        reply and a lookahead's, up to its cap."""
        conv = slot.conversation
        held = slot.parked[0].cells if slot.parked else conv.runner.cache.n_cells
        turn = new_tokens + n_predict + conv.runner.recall_cells
        return min(conv.cap, held + turn) + conv.runner.policy.lookahead_cells()

    def admit(self, need: int, slot: Slot | None) -> None:
        """Wait (holding self.lock) until `need` of the pool's cells are the turn's: the turns running
        keep what they reserved, and every other conversation is parked in host memory (slot: the
        turn's own, which stays; None: all may go). Idle ones go even when there is room, as
        llama-server's --cache-idle-slots does: attention spans the pool up to its highest cell in
        use, so their cells would slow every decode of the running turns (docs/serve.md, "Idle
        conversations leave the pool"). Then the slot's own conversation, if parked, is restored. A
        turn that needs more than the pool minus the running turns waits for them to end; each fits
        alone (Server._conversation)."""
        waited = False
        while True:
            for other in self.slots.all:
                if other is not slot and other.id not in self.reserved and other.resident:
                    self.park(other)
            if self.pool.ctx.n_ctx - sum(self.reserved.values()) >= need:
                break
            if not waited:
                waited = True
                self.metrics.wait()
            self.lock.wait()
        if slot is not None and slot.parked:
            slot.unpark()
            self.metrics.restore()

    def park(self, slot: Slot) -> None:
        slot.park()
        self.metrics.park(sum(s.parked_bytes for s in self.slots.all))

    def take(self, slot: Slot) -> None:
        """The slot for one request, once the request before it has let it go (holding self.lock)."""
        while slot.busy:
            self.lock.wait()
        slot.busy = True

    @contextlib.contextmanager
    def hold(self, slot: Slot) -> Iterator[None]:
        """The slot for this request alone (a slot file's), after the request that has it; in a pool,
        with the cells it holds reserved (no other request parks it meanwhile)."""
        with self.lock:
            self.take(slot)
            if self.pool is not None:
                self.reserved[slot.id] = slot.resident
        try:
            yield
        finally:
            with self.lock:
                self.let_go(slot)

    def let_go(self, slot: Slot) -> None:
        """The slot free for the next request, its cells no longer reserved (holding self.lock)."""
        slot.busy = False
        self.reserved.pop(slot.id, None)
        self.lock.notify_all()

    @contextlib.contextmanager
    def apart(self, need: int) -> Iterator[None]:
        """`need` cells reserved for work of no slot (a completion) while it runs."""
        key = object()
        with self.lock:
            self.admit(need, None)
            self.reserved[key] = need
        try:
            yield
        finally:
            with self.lock:
                del self.reserved[key]
                self.lock.notify_all()
