"""What `kvlite serve` was started with, checked once for every way of starting it."""

from __future__ import annotations

import dataclasses
import pathlib

from ..errors import KvliteError
from ..evict import check_evict
from ..limits import check_int
from ..policies import Policy, check_budget, make_policy
from ..settings import RunSettings


@dataclasses.dataclass
class ServeConfig:
    """What `kvlite serve` was started with. policy/params: the default for requests that name
    none (params as make_policy takes them, None = the policy's default)."""

    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    policy: str = "full"
    params: dict = dataclasses.field(default_factory=dict)
    settings: RunSettings = dataclasses.field(default_factory=RunSettings)
    evict: str | None = None  # None: per conversation, kvlite.evict.evict_mode's default
    n_predict: int = 256  # max_tokens when a request gives none
    max_tokens: int = 4096  # the most a request may ask for
    slots: int = 4
    # One pool of this many KV cells shared by every slot's conversation, their turns batched; 0: a
    # context a slot, one request at a time, the default (docs/serve.md, "The default")
    kv_cells: int = 0
    queue: int = 16  # requests waiting beyond the one running; more get a 503
    api_key: str | None = None
    max_body: int = 8 << 20  # bytes of a request body
    n_gpu_layers: int | None = None
    extra_bufts: bool = False
    model_alias: str | None = None
    slot_save_path: str | None = None  # where /slots/{id}?action=save|restore reads and writes
    recall: int = 0  # evicted cells a conversation's turn may bring back (kvlite.evict.check_recall)
    # the policy of a request that names none and sets none of its parameters, made once
    default_policy: Policy = dataclasses.field(init=False, repr=False)

    def __post_init__(self):
        if self.slots < 1:
            raise KvliteError(f"--slots must be at least 1, got {self.slots}")
        check_int("--kv-cells", self.kv_cells, 0)
        if self.kv_cells:
            from ..engine import MAX_LANES

            if 2 * self.slots > MAX_LANES:  # two lanes a slot (Server._make_pool)
                raise KvliteError(f"--slots with --kv-cells must be at most {MAX_LANES // 2}, got {self.slots}")
        if self.queue < 0:
            raise KvliteError(f"--queue must be 0 or more, got {self.queue}")
        if not 0 < self.port < 65536:
            raise KvliteError(f"--port must be in 1..65535, got {self.port}")
        check_evict(self.evict)
        if self.slot_save_path is not None and not pathlib.Path(self.slot_save_path).is_dir():
            raise KvliteError(f"--slot-save-path {self.slot_save_path} is not a directory")
        check_int("--max-tokens", self.max_tokens)
        check_int("--recall", self.recall)  # against the policy: cmd_serve and each request (parse_request)
        check_int("-n", self.n_predict, 0, self.max_tokens)
        if self.api_key is not None and not self.api_key.strip():
            raise KvliteError("--api-key is empty: give a key, or leave the flag out to serve without one")
        check_budget(self.policy, self.params.get("budget"))
        self.default_policy = make_policy(self.policy, **self.params)
