"""The server's counters, and /metrics in Prometheus' text format."""

from __future__ import annotations

import threading

from .. import recall_store


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[str, int] = {}
        self.errors = 0
        self.rejected = 0
        self.prompt_tokens = self.prefilled_tokens = self.completion_tokens = 0
        self.prefill_s = self.decode_s = self.evict_s = self.recall_s = 0.0
        self.parked = self.restored = 0  # conversations set aside in a pool, and brought back
        self.parked_bytes_peak = 0  # the most host memory the parked caches held at once
        self.waited = 0  # turns that waited for a pool's room while others ran

    def count(self, endpoint: str) -> None:
        with self.lock:
            self.requests[endpoint] = self.requests.get(endpoint, 0) + 1

    def reject(self) -> None:
        with self.lock:
            self.rejected += 1

    def park(self, parked_bytes: int) -> None:
        """A conversation parked; parked_bytes: what every parked cache holds now."""
        with self.lock:
            self.parked += 1
            self.parked_bytes_peak = max(self.parked_bytes_peak, parked_bytes)

    def restore(self) -> None:
        with self.lock:
            self.restored += 1

    def wait(self) -> None:
        with self.lock:
            self.waited += 1

    def error(self) -> None:
        with self.lock:
            self.errors += 1

    def add(self, prompt_tokens: int, completion_tokens: int, report: dict) -> None:
        """A request answered: its usage and its kvlite report (Server's)."""
        t = report["timings"]
        with self.lock:
            self.prompt_tokens += prompt_tokens
            self.prefilled_tokens += report["prefilled_tokens"]
            self.completion_tokens += completion_tokens
            self.prefill_s += t["prefill_s"]
            self.decode_s += t["decode_s"]
            self.evict_s += t["evict_s"]
            self.recall_s += t.get("recall_s", 0.0)

    def prometheus(self, waiting: int, slots: list[dict], steps: tuple[int, int] = (0, 0)) -> str:
        """The counters, then per slot (slots: their /slots states) its cells, budget and evictions.
        steps: a pool's decode steps and the decodes they carried (engine.batcher)."""
        with self.lock:
            by_endpoint = [(f'{{endpoint="{k}"}}', v) for k, v in sorted(self.requests.items())]
            rows = [
                ("requests_total", "counter", "Requests, by endpoint.", by_endpoint or [('{endpoint="chat"}', 0)]),
                ("requests_rejected_total", "counter", "Requests answered 503: the queue was full.",
                 [("", self.rejected)]),
                ("errors_total", "counter", "Requests that failed inside the server (500).", [("", self.errors)]),
                ("requests_waiting", "gauge", "Requests queued behind the ones running.", [("", waiting)]),
                ("prompt_tokens_total", "counter", "Prompt tokens of the requests answered.",
                 [("", self.prompt_tokens)]),
                ("prefilled_tokens_total", "counter", "Prompt tokens prefilled (the rest came from a slot's cache).",
                 [("", self.prefilled_tokens)]),
                ("completion_tokens_total", "counter", "Tokens generated.", [("", self.completion_tokens)]),
                ("prefill_tokens_per_second", "gauge", "Prefill throughput over all requests.",
                 [("", self.prefilled_tokens / self.prefill_s if self.prefill_s else 0)]),
                ("decode_tokens_per_second", "gauge", "Decode throughput over all requests.",
                 [("", self.completion_tokens / self.decode_s if self.decode_s else 0)]),
                ("prefill_seconds_total", "counter", "Time requests spent reading their prompts, their evictions "
                 "included.", [("", self.prefill_s)]),
                ("evict_seconds_total", "counter", "Time requests spent evicting (scoring, pruning, compacting).",
                 [("", self.evict_s)]),
                ("decode_seconds_total", "counter", "Time requests spent generating.", [("", self.decode_s)]),
                ("recall_seconds_total", "counter", "Time requests spent recalling evicted cells (--recall).",
                 [("", self.recall_s)]),
                ("recall_store_bytes", "gauge", "The conversations' stores of evicted cells (--recall), in host "
                 "memory (a parked conversation's is in parked_bytes too) and on disk beyond --recall-store.",
                 [('{where="ram"}', recall_store.ram_bytes()), ('{where="disk"}', recall_store.disk_bytes())]),
                ("conversations_parked_total", "counter", "Conversations whose cache a pool set aside in host "
                 "memory for another's turn (--kv-cells).", [("", self.parked)]),
                ("conversations_restored_total", "counter", "Parked conversations restored for their next turn.",
                 [("", self.restored)]),
                ("parked_bytes", "gauge", "Host memory of the parked conversations' caches.",
                 [("", sum(slot["parked_bytes"] for slot in slots))]),
                ("parked_bytes_peak", "gauge", "The most host memory the parked caches held at once.",
                 [("", self.parked_bytes_peak)]),
                ("turns_waited_total", "counter", "Turns that waited for a pool's cells held by running turns.",
                 [("", self.waited)]),
                ("decode_steps_total", "counter", "llama_decode calls of a pool (--kv-cells).", [("", steps[0])]),
                ("batched_decodes_total", "counter", "Decodes those steps carried: a step carries every "
                 "conversation's that waits (continuous batching).", [("", steps[1])]),
            ]  # fmt: skip
        labelled = [(f'{{slot="{s["id"]}"}}', s) for s in slots]
        rows += [
            ("slot_resident_cells", "gauge", "KV cells resident in a slot's cache.",
             [(label, s["resident_cells"]) for label, s in labelled]),
            ("slot_budget_cells", "gauge", "A slot's KV budget (0: none).",
             [(label, s["budget"] or 0) for label, s in labelled]),
            ("slot_evicted_cells_total", "counter", "KV cells a slot's conversation has evicted.",
             [(label, s["evicted_cells"]) for label, s in labelled]),
        ]  # fmt: skip
        lines = []
        for name, kind, doc, samples in rows:
            lines += [f"# HELP kvlite_{name} {doc}", f"# TYPE kvlite_{name} {kind}"]
            lines += [f"kvlite_{name}{labels} {value}" for labels, value in samples]
        return "\n".join(lines) + "\n"
