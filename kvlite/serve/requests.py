"""Every endpoint's request, parsed and checked: what the server acts on, or an ApiError in OpenAI's
shape. Nothing here touches the model."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

from ..api import ROLES, check_text
from ..engine import SamplingParams
from ..errors import KvliteError
from ..evict import chat_ctx, check_recall
from ..policies import ALL_PARAMS, Policy, check_budget, make_policy
from ..settings import check_budget_fits
from .config import ServeConfig

MAX_STOP = 4  # OpenAI's limit on stop sequences
SLOT_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
SLOT_ACTIONS = ("save", "restore", "erase")


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def parse_body(data: bytes) -> dict:
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def field(body: dict, name: str, kind: type | tuple, default: Any = None) -> Any:
    """body[name] if it is of this kind (a missing or null field: default)."""
    value = body.get(name, default)
    if value is None:
        return default
    # JSON true is not a number here, and an integer is a fine float
    ok = isinstance(value, kind) and not (isinstance(value, bool) and bool not in _types(kind))
    if not ok and float in _types(kind) and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        names = " or ".join(t.__name__ for t in _types(kind))
        raise ApiError(400, f"'{name}' must be {names}, got {json.dumps(value)[:80]}", param=name)
    return value


def _types(kind: type | tuple) -> tuple:
    return kind if isinstance(kind, tuple) else (kind,)


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or OpenAI's list of parts of which only text is supported."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}: only text content parts are supported", param="messages")
            out.append(part["text"])
        return "".join(out)
    raise ApiError(400, f"{where}: 'content' must be a string or a list of text parts", param="messages")


def _checked_text(text: str, what: str, param: str) -> str:
    try:  # as kvlite chat and generate refuse it (a NUL in any message: the template's check)
        check_text(text, what)
    except KvliteError as e:
        raise ApiError(400, str(e), param=param) from None
    return text


def parse_messages(body: dict) -> list[dict]:
    """/v1/chat/completions' messages."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}]: 'role' must be one of {', '.join(ROLES)}", param="messages")
        out.append({"role": m["role"], "content": _text(m.get("content"), f"messages[{i}]")})
    if out[-1]["role"] != "user":
        raise ApiError(400, "the last message must be the user's", param="messages")
    _checked_text(out[-1]["content"], "the last user message", "messages")
    return out


def parse_prompt(body: dict) -> str:
    """/v1/completions' prompt: a string, or a list of one."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ApiError(400, "'prompt' must be a string (or a list of one)", param="prompt")
    return _checked_text(prompt, "the prompt", "prompt")  # as kvlite generate words it


@dataclasses.dataclass
class Ask:
    """What a completion request asks, validated."""

    policy: Policy
    n_predict: int
    sampling: SamplingParams
    stop: list[str]
    stream: bool
    conversation_id: str | None = None
    budget_share: str | None = None  # kv_budget as asked ("2%"), where the policy's budget is its cells
    recall: int = 0  # kv_recall: evicted cells a conversation's turn may bring back


def parse_request(body: dict, cfg: ServeConfig, default_sampling: SamplingParams) -> Ask:
    """What both completion endpoints share: max_tokens, sampling, stop, stream, the policy."""
    n = field(body, "max_completion_tokens", int, None)
    n = field(body, "max_tokens", int, cfg.n_predict) if n is None else n
    if not 0 <= n <= cfg.max_tokens:
        raise ApiError(400, f"'max_tokens' must be in 0..{cfg.max_tokens}, got {n}", param="max_tokens")
    if field(body, "n", int, 1) != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    temp = field(body, "temperature", float, default_sampling.temp)
    top_p = field(body, "top_p", float, default_sampling.top_p)
    top_k = field(body, "top_k", int, default_sampling.top_k)
    seed = field(body, "seed", int, default_sampling.seed)
    for name, v in (("temperature", temp), ("top_p", top_p)):
        if not math.isfinite(v):
            raise ApiError(400, f"'{name}' must be a finite number", param=name)
    try:
        sampling = SamplingParams(temp=temp, top_k=top_k, top_p=top_p, seed=seed)
    except KvliteError as e:
        names = {"--temp": "temperature", "--top-p": "top_p", "--top-k": "top_k", "--seed": "seed"}
        message = str(e)
        for flag, name in names.items():
            message = message.replace(flag, name)
        raise ApiError(400, message) from None
    stop = field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, f"'stop' must be a string or a list of at most {MAX_STOP} non-empty strings", param="stop")
    cid = field(body, "conversation_id", str, None)
    policy = parse_policy(body, cfg)
    recall = field(body, "kv_recall", int, cfg.recall if policy.name == cfg.policy else 0)
    try:
        recall = check_recall(recall, policy, "kv_recall")
    except KvliteError as e:
        raise ApiError(400, str(e), param="kv_recall") from None
    return Ask(
        policy=policy,
        recall=recall,
        n_predict=n,
        sampling=sampling,
        stop=stop,
        stream=field(body, "stream", bool, False),
        conversation_id=cid,
    )


def parse_policy(body: dict, cfg: ServeConfig) -> Policy:
    """kv_policy, kv_budget and the policy's parameters under their Python API names; what a
    request leaves out comes from the server's flags (those of another policy do not carry over)."""
    for key in body:
        if key.startswith("kv_") and key not in ("kv_policy", "kv_budget", "kv_recall"):
            raise ApiError(400, f"unknown field '{key}': kv_policy, kv_budget, kv_recall, or a policy parameter "
                           f"({', '.join(p for p in ALL_PARAMS if p != 'budget')})", param=key)  # fmt: skip
    if "budget" in body:
        raise ApiError(400, "the budget is 'kv_budget'", param="budget")
    name = field(body, "kv_policy", str, cfg.policy)
    # the server's flags hold for its own policy; for another, only its budget carries over (not to full)
    carried = {} if name == "full" else {"budget": cfg.params.get("budget")}
    params = dict(cfg.params) if name == cfg.policy else carried
    given = {p: body[p] for p in ALL_PARAMS if p in body and p != "budget"}
    if "kv_budget" in body:
        given["budget"] = field(body, "kv_budget", (int, str))
        if isinstance(given["budget"], str) and not given["budget"].strip().endswith("%"):
            raise ApiError(400, "'kv_budget' is KV cells (an integer) or a share of the prompt (\"2%\")",
                           param="kv_budget")  # fmt: skip
    for p, v in given.items():
        if isinstance(v, bool) or (isinstance(v, float) and not math.isfinite(v)):
            raise ApiError(400, f"'{p}' cannot be {json.dumps(v)}", param=p)
    try:
        if name == cfg.policy and not given:
            policy = cfg.default_policy
        else:
            check_budget(name, {**params, **given}.get("budget"), "kv_policy", "kv_budget")
            policy = make_policy(name, **{**params, **given})
        check_budget_fits(policy, chat_ctx(cfg.settings.n_ctx, policy), "kv_budget")  # before a stream's 200
    except (KvliteError, TypeError, ValueError) as e:
        raise ApiError(400, str(e), param="kv_policy") from None
    return policy


@dataclasses.dataclass
class Tokenize:
    content: str
    add_special: bool
    parse_special: bool
    with_pieces: bool


def parse_tokenize(body: dict) -> Tokenize:
    content = body.get("content")
    if not isinstance(content, str):
        raise ApiError(400, "'content' must be a string", param="content")
    return Tokenize(content, field(body, "add_special", bool, False),
                    field(body, "parse_special", bool, True),  # llama-server's default
                    field(body, "with_pieces", bool, False))  # fmt: skip


def parse_detokenize(body: dict, n_vocab: int) -> list[int]:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < n_vocab for t in tokens):
        raise ApiError(400, f"'tokens' must be a list of token ids in 0..{n_vocab - 1}", param="tokens")
    return tokens


def parse_slot_action(slot_id: str, action: str) -> int:
    """POST /slots/{id}?action=...: the slot's number (its range is the slots' to check)."""
    if not slot_id.isdigit():
        raise ApiError(400, f"no slot '{slot_id}'")
    if action not in SLOT_ACTIONS:
        raise ApiError(400, "'action' must be save, restore or erase", param="action")
    return int(slot_id)


def parse_filename(filename: Any) -> str:
    """A slot file's name: a plain name inside --slot-save-path, never a path."""
    if not isinstance(filename, str) or not SLOT_FILE.fullmatch(filename):
        raise ApiError(400, "'filename' must be a plain file name (letters, digits, '.', '_', '-')",
                       param="filename")  # fmt: skip
    return filename
