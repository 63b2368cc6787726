"""The Python API: a model and a policy, then `generate` (one prompt, a fresh cache) or `chat`
(a conversation whose compressed cache persists across turns).

    import kvlite
    s = kvlite.Session(policy=kvlite.EchoKV(budget=256))
    print(s.generate(open("report.txt").read() + "\\nSummarize.", chat=True).text)
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from .engine import Model, SamplingParams
from .models import resolve_model
from .policies import FullKV, Policy
from .runner import DEFAULT_CHUNK, Generation, Runner, plan_context

if TYPE_CHECKING:
    from .chat import Conversation


class Session:
    def __init__(
        self,
        model: str | pathlib.Path | Model | None = None,
        policy: Policy | None = None,
        n_ctx: int = 0,
        chunk: int = DEFAULT_CHUNK,
        sampling: SamplingParams | None = None,
        n_threads: int | None = None,
        flash_attn: bool = False,
    ):
        """model: a GGUF path, a loaded Model, or None for the default (SmolLM2-135M-Instruct);
        n_ctx: context cells, 0 = as needed (see runner.plan_context)."""
        self.model = model if isinstance(model, Model) else Model(resolve_model(model))
        self.policy = policy or FullKV()
        self.policy.validate()
        self.n_ctx, self.chunk = n_ctx, chunk
        self.sampling, self.n_threads, self.flash_attn = sampling, n_threads, flash_attn
        self._conversation = None

    def _runner(self, n_ctx: int, n_tokens: int, n_predict: int) -> Runner:
        n_ctx, chunk = plan_context(self.policy, n_ctx, n_tokens, n_predict, self.chunk)
        return Runner(self.model, self.policy, n_ctx=n_ctx, chunk=chunk, sampling=self.sampling,
                      n_threads=self.n_threads, flash_attn=self.flash_attn)  # fmt: skip

    def generate(
        self,
        prompt: str,
        n_predict: int = 128,
        chat: bool = False,
        on_text: Callable[[str], None] | None = None,
        progress: bool = False,
    ) -> Generation:
        """Complete one prompt on a fresh cache (chat=True wraps it as a user turn of the template).
        progress: a prefill progress bar on stderr when it is a terminal."""
        from .errors import KvliteError
        from .progress import progress_bar

        if not prompt.strip():
            raise KvliteError("the prompt is empty")
        if n_predict < 0:
            raise KvliteError(f"-n must be >= 0, got {n_predict}")
        text = self.model.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
        tokens = self.model.tokenize(text, add_special=True, parse_special=chat)
        runner = self._runner(self.n_ctx, len(tokens), n_predict)
        try:
            with progress_bar(len(tokens) if progress else 0, "prefill", min_total=max(1, 2 * runner.chunk)) as bar:
                runner.feed(tokens, progress=bar)
            out, stopped = runner.generate(n_predict, on_text=on_text)
            return Generation(
                text=self.model.detokenize(out),
                prompt_tokens=len(tokens),
                generated_tokens=len(out),
                stopped=stopped,
                cache=runner.cache_report(len(tokens)),
                timings=runner.timings.as_dict(),
            )
        finally:
            runner.close()

    def conversation(self, system: str | None = None) -> Conversation:
        """A new conversation on its own context: 4096 cells unless the policy evicts continuously
        (then budget + chunk) or n_ctx says otherwise."""
        from .chat import CHAT_CTX, Conversation

        n_ctx = self.n_ctx or (0 if self.policy.continuous else CHAT_CTX)
        return Conversation(self._runner(n_ctx, 0, 0), system=system)

    def chat(self, message: str, n_predict: int = 256, on_text: Callable[[str], None] | None = None) -> str:
        """One turn of a conversation; the cache (compressed by the policy) carries over."""
        if self._conversation is None:
            self._conversation = self.conversation()
        reply, _ = self._conversation.turn(message, n_predict, on_text, lambda: False)
        return reply

    def reset(self) -> None:
        """Forget the conversation."""
        if self._conversation is not None:
            self._conversation.reset()
