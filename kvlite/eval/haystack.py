"""Real prose for haystacks, from two independent sources:

- `haystack`: paragraphs of the standard library's docstrings (any Python install): the haystack of
  kvlite's needle tests and benchmarks, and the *tune* split of evaluations.
- `news`: the Lee news corpus (300 Australian news articles of 2001, Lee, Pincombe and Welsh 2005),
  which ships in the gensim wheel as test data: the *test* split. Installed with
  `pip install --no-deps gensim`; it is read as a file, never imported."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import pathlib

from ..errors import KvliteError

NEWS_PACKAGE = "gensim==4.4.0"
NEWS_FILE = ("test", "test_data", "lee_background.cor")

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


@functools.lru_cache(maxsize=1)
def news_path() -> pathlib.Path:
    spec = importlib.util.find_spec("gensim")  # locates the package without importing it (or scipy)
    path = pathlib.Path(spec.submodule_search_locations[0]).joinpath(*NEWS_FILE) if spec else None
    if path is None or not path.is_file():
        raise KvliteError(
            f"the test split's prose (the Lee news corpus) ships in the gensim wheel: "
            f"pip install --no-deps '{NEWS_PACKAGE}' (scripts/setup.sh does)"
        )
    return path


@functools.lru_cache(maxsize=1)
def _articles() -> tuple[str, ...]:
    """The corpus read once per process (every generated sample builds from it)."""
    text = news_path().read_text(encoding="utf-8")
    return tuple(" ".join(line.split()) for line in text.splitlines() if line.strip())


def news(n_paragraphs: int) -> list[str]:
    """Up to n_paragraphs news articles, one paragraph each, in the corpus's order (a new list:
    callers may insert into it)."""
    return list(_articles()[:n_paragraphs])


SOURCES = {"docstrings": haystack, "news": news}


def needle_prompt(n_paragraphs: int, depth: float, needle: str, question: str) -> str:
    paras = haystack(n_paragraphs)
    paras.insert(int(len(paras) * depth), needle)
    return "Read the text and answer the question at the end.\n\n" + "\n\n".join(paras) + "\n\n" + question
