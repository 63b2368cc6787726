"""A loaded GGUF model: weights, vocabulary, tokenizer and chat template (llama.cpp low-level API)."""

from __future__ import annotations

import codecs
import ctypes
import pathlib
import weakref
from collections.abc import Sequence

import llama_cpp as L

from ..errors import KvliteError
from ..models import ModelInfo, read_model_info

_log_callback = None
LOG_ERRORS: list[str] = []  # llama.cpp's error lines, kept for the messages of failures
LOG_BUFFERS: list[str] = []  # its "<device> <kind> buffer size = N MiB" lines since the last context


def quiet_llama_logs() -> None:
    """Silence llama.cpp's chatter but keep its error lines (GGML_LOG_LEVEL_ERROR = 4)."""
    global _log_callback
    if _log_callback is not None:
        return

    @L.llama_log_callback
    def _callback(level, text, _user):
        if level == 4 and text:
            LOG_ERRORS.append(text.decode(errors="replace").strip())
            del LOG_ERRORS[:-20]
        elif text and b"buffer size =" in text:
            LOG_BUFFERS.append(text.decode(errors="replace").strip())

    _log_callback = _callback
    L.llama_log_set(_callback, None)


quiet_llama_logs()
L.llama_backend_init()


def logged_buffers(kind: str) -> dict[str, float]:
    """{device: MiB} of the `kind` buffers ("model", "KV", "compute") llama.cpp logged since
    LOG_BUFFERS was last cleared (e.g. {"RPC0[127.0.0.1:50052]": 0.09} for an offloaded cache),
    summed per device (a sliding-window model logs one KV buffer per cache)."""
    out: dict[str, float] = {}
    for line in LOG_BUFFERS:
        head, _, size = line.partition(f" {kind} buffer size =")
        if size:
            device = head.split(":", 1)[1].strip()
            out[device] = out.get(device, 0.0) + float(size.split()[0])
    return out


def offloaded_layers(n_gpu_layers: int | None, n_layer: int) -> int:
    """What -ngl means here: None = every layer when ggml sees a GPU (CUDA, Metal, or an RPC server
    added with --rpc); never more than the model's layers plus its output layer (llama.cpp counts
    that one too); 0 without a GPU."""
    from ..native import default_device

    if n_gpu_layers is not None and n_gpu_layers < 0:
        raise KvliteError(f"-ngl must be 0 or more layers, got {n_gpu_layers}")
    if default_device() == "cpu":
        return 0
    return n_layer + 1 if n_gpu_layers is None else min(n_gpu_layers, n_layer + 1)


class Model:
    """Weights and vocabulary, shared by every context made from them."""

    def __init__(self, path: str | pathlib.Path, use_extra_bufts: bool = False, n_gpu_layers: int | None = None,
                 vocab_only: bool = False):  # fmt: skip
        """n_gpu_layers: llama.cpp's -ngl, layers whose weights (and KV cache) live on the GPU;
        None: all of them when ggml sees a GPU (0 on a CPU build without --rpc). vocab_only: the
        tokenizer and chat template alone (no weights: no context can be made)."""
        self.info: ModelInfo = read_model_info(path)  # validates before llama.cpp sees the file
        params = L.llama_model_default_params()
        self.n_gpu_layers = offloaded_layers(n_gpu_layers, self.info.n_layer)
        params.n_gpu_layers = self.n_gpu_layers
        # On CPU builds the AMX/repack buffers crash the first decode on AMX-capable CPUs (docs/design.md).
        params.use_extra_bufts = use_extra_bufts
        params.vocab_only = vocab_only
        self.ptr = L.llama_model_load_from_file(str(path).encode(), params)
        if not self.ptr:
            detail = LOG_ERRORS[-1] if LOG_ERRORS else "no detail"
            raise KvliteError(f"llama.cpp could not load {path}: {detail}")
        self.vocab = L.llama_model_get_vocab(self.ptr)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.path = pathlib.Path(path)
        # A llama_context reads its model when it is freed, so the contexts go first. At interpreter
        # exit the garbage collector finalizes a model and its contexts in any order.
        self.contexts: weakref.WeakSet = weakref.WeakSet()

    def close(self) -> None:
        if getattr(self, "ptr", None):
            for ctx in list(getattr(self, "contexts", ())):
                ctx.close()
            L.llama_model_free(self.ptr)
            self.ptr = None

    def __del__(self) -> None:
        self.close()

    # -- tokens ---------------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """parse_special: read text such as <|im_start|> as control tokens (only a template's own
        markers should be: user text never is, see tokenize_chat)."""
        try:
            data = text.encode()
        except UnicodeEncodeError:
            raise KvliteError("the text is not valid UTF-8") from None
        n = len(data) + 16
        buf = (L.llama_token * n)()
        k = L.llama_tokenize(self.vocab, data, len(data), buf, n, add_special, parse_special)
        if k < 0:  # the buffer was too small: -k tokens are needed
            n = -k
            buf = (L.llama_token * n)()
            k = L.llama_tokenize(self.vocab, data, len(data), buf, n, add_special, parse_special)
        if k < 0:
            raise KvliteError("tokenization failed")
        return list(buf[:k])

    def piece(self, token: int, special: bool = False) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> str:
        return b"".join(self.piece(t, special) for t in tokens).decode(errors="replace")

    def text_stream(self) -> TextStream:
        return TextStream(self)

    def is_eog(self, token: int) -> bool:
        return bool(L.llama_vocab_is_eog(self.vocab, token))

    # -- chat -----------------------------------------------------------------------------------
    @property
    def chat_template(self) -> bytes | None:
        return L.llama_model_chat_template(self.ptr, None) or None

    def apply_chat_template(self, messages: Sequence[dict], add_assistant: bool = True) -> str:
        """Render messages with the GGUF's template, through llama.cpp's built-in template engine."""
        tmpl = self.chat_template
        if tmpl is None:
            raise KvliteError(f"{self.path.name} has no chat template: use `kvlite generate` instead")
        try:
            keep = [(m["role"].encode(), m["content"].encode()) for m in messages]
        except UnicodeEncodeError:
            raise KvliteError("a message is not valid UTF-8") from None
        if any(b"\x00" in c for _, c in keep):  # the C API would end the message there, silently
            raise KvliteError("a message contains a NUL character: remove it")
        arr = (L.llama_chat_message * len(keep))(*[L.llama_chat_message(r, c) for r, c in keep])
        size = 256 + 2 * sum(len(c) + len(r) for r, c in keep)
        buf = ctypes.create_string_buffer(size)
        n = L.llama_chat_apply_template(tmpl, arr, len(keep), add_assistant, buf, size)
        if n > size:
            buf = ctypes.create_string_buffer(n)
            n = L.llama_chat_apply_template(tmpl, arr, len(keep), add_assistant, buf, n)
        if n < 0:
            raise KvliteError(f"llama.cpp does not know the chat template of {self.path.name}")
        return buf.raw[:n].decode(errors="replace")

    def chat_segments(self, messages: Sequence[dict], add_assistant: bool = True) -> list[tuple[str, bool]]:
        """The rendered conversation as (text, is_message_text) pieces, so that message text can be
        tokenized without reading control tokens in it. A template that rewrites message text
        (trims it, say) cannot be split this way: it comes back as one piece of template."""
        rendered = self.apply_chat_template(messages, add_assistant)
        marks = [f"\x1ekvlite-{i}\x1e" for i in range(len(messages))]
        marked = self.apply_chat_template([{**m, "content": k} for m, k in zip(messages, marks)], add_assistant)
        pieces: list[tuple[str, bool]] = []
        rest = marked
        for m, mark in zip(messages, marks):
            before, found, rest = rest.partition(mark)
            if not found:
                return [(rendered, False)]
            pieces += [(before, False), (m["content"], True)]
        pieces.append((rest, False))
        if "".join(t for t, _ in pieces) != rendered:
            return [(rendered, False)]
        return [(t, c) for t, c in pieces if t]

    def tokenize_pieces(self, pieces: Sequence[tuple[str, bool]], add_special: bool = True) -> list[int]:
        """Tokens of (text, is_message_text) pieces: message text literally, the template's own
        text with its control tokens."""
        out: list[int] = []
        for text, literal in pieces:
            out += self.tokenize(text, add_special=add_special and not out, parse_special=not literal)
        return out

    def tokenize_chat(self, messages: Sequence[dict], add_assistant: bool = True) -> list[int]:
        """The conversation rendered by the template and tokenized; text like <|im_end|> inside a
        message stays text, so a prompt cannot end its own turn."""
        return self.tokenize_pieces(self.chat_segments(messages, add_assistant))


def drop_prefix(pieces: Sequence[tuple[str, bool]], n_chars: int) -> list[tuple[str, bool]]:
    """The pieces after their first n_chars characters."""
    out = []
    for text, literal in pieces:
        if n_chars >= len(text):
            n_chars -= len(text)
            continue
        out.append((text[n_chars:], literal))
        n_chars = 0
    return out


class TextStream:
    """Token-by-token text with UTF-8 sequences split across tokens held back until complete."""

    def __init__(self, model: Model):
        self._model = model
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._decoder.decode(self._model.piece(token))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)
