"""Real prose available on any Python install: paragraphs of the standard library's docstrings,
in a deterministic order. The haystack of kvlite's needle tests and benchmarks."""

from __future__ import annotations

import importlib

MODULES = ("argparse", "collections", "json", "logging", "pathlib", "subprocess", "textwrap")


def haystack(n_paragraphs: int) -> list[str]:
    """Up to n_paragraphs paragraphs of mostly-letters prose (module docs, then public members)."""
    paras: list[str] = []
    for name in MODULES:
        mod = importlib.import_module(name)
        for obj in [mod, *[getattr(mod, n) for n in sorted(dir(mod)) if not n.startswith("_")]]:
            for p in (getattr(obj, "__doc__", None) or "").split("\n\n"):
                p = " ".join(p.split())
                if len(p) > 200 and sum(ch.isalpha() for ch in p) > 0.75 * len(p):
                    paras.append(p)
    return list(dict.fromkeys(paras))[:n_paragraphs]


def needle_prompt(n_paragraphs: int, depth: float, needle: str, question: str) -> str:
    paras = haystack(n_paragraphs)
    paras.insert(int(len(paras) * depth), needle)
    return "Read the text and answer the question at the end.\n\n" + "\n\n".join(paras) + "\n\n" + question
