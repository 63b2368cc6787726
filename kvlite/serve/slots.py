"""The server's slots: which one a request's messages continue, and the least recently used one to
give up. Their files are kvlite.slotfile's."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from ..api import Conversation
from ..cache import Snapshot
from ..engine import kvstate
from ..errors import KvliteError
from ..policies import Policy


@dataclasses.dataclass
class Slot:
    """A conversation's cache. key: the policy and mode it was compressed by (a request under
    another cannot continue it)."""

    id: int
    conversation: Conversation | None = None
    key: str = ""
    conversation_id: str | None = None
    last_used: float = 0.0
    requests: int = 0
    # In a pool (--kv-cells): the conversation's cache set aside in host memory to give its cells to
    # another, and how many positions it had evicted; restored when the slot is next used.
    parked: tuple[Snapshot, int] | None = None
    busy: bool = False  # a request has it (room.py)

    @property
    def resident(self) -> int:
        """Cells the slot holds in the context (none while parked)."""
        return self.conversation.runner.cache.n_cells if self.conversation and not self.parked else 0

    @property
    def parked_bytes(self) -> int:
        """Host memory its parked cache holds (0 when it is not parked)."""
        return self.parked[0].nbytes if self.parked else 0

    @property
    def store_bytes(self) -> int:
        """Bytes of its conversation's store of evicted cells (--recall), parked or not, in host
        memory or on disk (recall_store.py)."""
        if self.parked:
            return kvstate.nbytes(self.parked[0].store)
        return kvstate.nbytes(self.conversation.runner.cache.store) if self.conversation else 0

    def park(self) -> None:
        cache = self.conversation.runner.cache
        self.parked = (cache.snapshot(), cache.evicted)
        cache.reset()

    def unpark(self) -> None:
        """The parked cache back in the context, as it was (the runner's observed queries too)."""
        snap, evicted = self.parked
        self.conversation.runner.cache.restore(snap, evicted)
        self.parked = None

    @property
    def messages(self) -> list[dict]:
        return self.conversation.messages if self.conversation else []

    def state(self) -> dict:
        """What GET /slots shows of it."""
        conv = self.conversation
        cache = conv.runner.cache if conv else None
        return {
            "id": self.id,
            "is_processing": self.busy,
            "parked": self.parked is not None,
            "parked_bytes": self.parked_bytes,
            "store_bytes": self.store_bytes,
            "conversation_id": self.conversation_id,
            "policy": repr(conv.runner.policy) if conv else None,
            "budget": conv.runner.policy.budget if conv else None,
            "messages": len(self.messages),
            "n_pos": cache.n_pos if cache else 0,
            "resident_cells": self.resident,
            "evicted_cells": cache.evicted if cache else 0,
            "requests": self.requests,
            "last_used": self.last_used or None,
        }

    def hold(self, conversation: Conversation, key: str, conversation_id: str | None) -> None:
        """Take a new conversation, freeing the context (or the pool lane) of the one it held."""
        if self.conversation is not None and self.conversation is not conversation:
            self.conversation.runner.close()
        self.conversation, self.key, self.conversation_id = conversation, key, conversation_id
        self.parked = None

    def start_over(self, conversation_id: str | None) -> None:
        """Keep the conversation (its context or lane), forget what it said and held."""
        self.parked = None
        if self.conversation is not None:
            self.conversation.reset()
        self.conversation_id = conversation_id

    def close(self) -> None:
        if self.conversation is not None:
            self.conversation.runner.close()
            self.conversation = None
        self.parked = None


def slot_key(policy: Policy, evict: str, recall: int = 0) -> str:
    """Which requests may continue a slot's conversation: those under the same policy and mode, and
    alike in keeping evicted cells for recall or not (how many come back is each request's)."""
    return f"{policy!r} {evict}" + (" recall" if recall else "")


class Slots:
    """N slots, each holding at most one conversation's compressed cache."""

    def __init__(self, n: int):
        self.all = [Slot(i) for i in range(n)]

    def __getitem__(self, slot_id: int) -> Slot:
        if not 0 <= slot_id < len(self.all):
            raise KvliteError(f"no slot {slot_id}: the slots are 0..{len(self.all) - 1}")
        return self.all[slot_id]

    def busy_with(self, conversation_id: str | None) -> bool:
        """Whether a request holds the slot of this conversation (None: none named)."""
        return conversation_id is not None and any(s.busy and s.conversation_id == conversation_id for s in self.all)

    def pick(self, messages: list[dict], key: str, conversation_id: str | None,
             start: Callable[[], Conversation]) -> tuple[Slot, list[dict]]:  # fmt: skip
        """The slot whose conversation the messages extend (longest match), else the free or least
        recently used one, started over (start: a new conversation under the request's policy).
        Slots another request holds are not candidates (there is always one free: a request at
        most holds one). Returns it and the messages it has not read."""
        idle = [s for s in self.all if not s.busy]
        if conversation_id is not None:
            slot = next((s for s in idle if s.conversation_id == conversation_id), None)
            candidates = [slot] if slot else []
        else:
            candidates = idle

        def extends(s: Slot) -> bool:
            held = s.messages
            return s.key == key and 0 < len(held) < len(messages) and messages[: len(held)] == held

        matches = [s for s in candidates if extends(s)]
        if matches:
            best = max(matches, key=lambda s: len(s.messages))
            return best, messages[len(best.messages) :]
        if conversation_id is not None and candidates:
            slot = candidates[0]  # its conversation, started over
        else:
            slot = min(idle, key=lambda s: (s.conversation is not None, s.last_used))  # free, else LRU
        if slot.conversation is not None and slot.key == key:
            slot.start_over(conversation_id)
        else:
            slot.close()  # its context is freed before the next is allocated
            slot.hold(start(), key, conversation_id)
        return slot, messages

    def used(self, slot: Slot) -> None:
        slot.last_used, slot.requests = time.time(), slot.requests + 1

    def close(self) -> None:
        for s in self.all:
            s.close()
