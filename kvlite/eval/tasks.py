"""Generated long-context tasks, deterministic from a seed and the model's tokenizer: the answer and
the evidence positions are known, so accuracy, fidelity and evidence retention can all be measured
offline. The haystack is real prose (kvlite.haystack: standard-library docstrings).

Layouts follow RULER and the calibration in notes/calibration.md (what SmolLM2-135M and
Qwen2.5-Coder-0.5B solve with the full cache)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

from ..errors import KvliteError
from ..haystack import haystack

MAGIC_INTRO = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards."
)
WORDS = (
    "amber", "brisk", "cedar", "dune", "ember", "fable", "glacier", "harbor", "iris", "juniper", "kestrel", "lagoon",
    "meadow", "nimbus", "orchid", "pepper", "quartz", "raven", "saffron", "tundra", "umber", "velvet", "willow",
    "zephyr",
)  # fmt: skip
CITIES = (
    "Lisbon", "Oslo", "Quito", "Hanoi", "Dakar", "Lima", "Perth", "Tunis", "Riga", "Porto", "Minsk", "Accra", "Bern",
    "Cairo", "Delhi", "Kyoto",
)  # fmt: skip
PEOPLE = ("Alice", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kofi", "Lena")


@dataclasses.dataclass
class Sample:
    """One prompt with its gold answers. evidence: character spans of `prompt` that hold what the
    answer needs (empty when unknown, as in LongBench files)."""

    task: str
    id: int
    prompt: str
    answers: list[str]
    metric: str
    max_new_tokens: int
    chat: bool = True
    evidence: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    all_classes: list[str] | None = None


def _code(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def _key(rng: random.Random, taken: set[str]) -> str:
    while True:
        key = f"{rng.choice(WORDS)}-{rng.choice(WORDS)}"
        if key not in taken and key.split("-")[0] != key.split("-")[1]:
            taken.add(key)
            return key


class Builder:
    """Fills a prompt with haystack paragraphs up to a target length in tokens and places
    statements at depths (0 = start, 1 = end), recording where each statement lands."""

    def __init__(self, count_tokens: Callable[[str], int], rng: random.Random):
        self.count = count_tokens
        self.rng = rng

    def build(self, head: str, statements: list[tuple[float, str]], tail: str, target: int) -> tuple[str, list]:
        pool = haystack(400)
        start = self.rng.randrange(len(pool))
        budget = target - self.count(head + tail + " ".join(s for _, s in statements)) - 16
        paras: list[str] = []
        used = 0
        while used < budget:
            p = pool[(start + len(paras)) % len(pool)]
            n = self.count(p) + 2
            if used + n > budget:  # the last paragraph is cut to fit, in whole words
                words = p.split()
                p = " ".join(words[: max(1, len(words) * (budget - used) // n)])
            paras.append(p)
            used += n
            if len(paras) > 4 * len(pool):
                raise KvliteError(f"could not fill {target} tokens of haystack")
        slots = sorted(((round(depth * len(paras)), i) for i, (depth, _) in enumerate(statements)), reverse=True)
        for at, i in slots:  # later slots first, so earlier indices stay valid
            paras.insert(at, statements[i][1])
        text = head + "\n\n" + "\n\n".join(paras) + "\n\n" + tail
        spans = []
        for _, s in statements:
            at = text.index(s)
            spans.append((at, at + len(s)))
        return text, spans


def single_needle(b: Builder, target: int, depth: float) -> tuple[str, list[str], list]:
    key, value = _key(b.rng, set()), _code(b.rng)
    needle = f"The special magic number for {key} is: {value}."
    q = f"What is the special magic number for {key} mentioned in the provided text?"
    text, spans = b.build(MAGIC_INTRO, [(depth, needle)], q, target)
    return text, [value], spans


def multi_key(b: Builder, target: int, depth: float, n_keys: int = 4) -> tuple[str, list[str], list]:
    """n_keys needles of the same form, one asked for: the others are distractors."""
    taken: set[str] = set()
    needles = [(_key(b.rng, taken), _code(b.rng)) for _ in range(n_keys)]
    asked = b.rng.randrange(n_keys)
    depths = [(depth + i / n_keys) % 1.0 for i in range(n_keys)]
    statements = [(d, f"The special magic number for {k} is: {v}.") for d, (k, v) in zip(depths, needles)]
    q = f"What is the special magic number for {needles[asked][0]} mentioned in the provided text?"
    text, spans = b.build(MAGIC_INTRO, statements, q, target)
    return text, [needles[asked][1]], [spans[asked]]


def two_hop(b: Builder, target: int, depth: float) -> tuple[str, list[str], list]:
    """Two facts far apart that must be joined: who lives where (at `depth`), and the code of that
    city (half the text later). The question names neither the city nor the code, and comes first
    as well as last: asked only at the end, both test models answered with the city (calibration
    in docs/results.md)."""
    person = b.rng.choice(PEOPLE)
    city = b.rng.choice(CITIES)
    code = _code(b.rng)
    facts = [(depth, f"{person} lives in {city}."), ((depth + 0.5) % 1.0, f"The secret code of {city} is {code}.")]
    q = f"What is the secret code of the city where {person} lives?"
    head = "Read the text. Some facts about people and cities are hidden in it. Afterwards, answer this question: " + q
    text, spans = b.build(head, facts, q, target)
    return text, [code], spans


def variable_tracking(b: Builder, target: int, depth: float, hops: int = 4) -> tuple[str, list[str], list]:
    """RULER's vt: a chain VAR A = value, VAR B = VAR A, ... spread through the text; the answer is
    every variable of the chain. The question also comes first (Qwen needs it there, calibration)."""
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(b.rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in names:
            names.append(name)
    value = _code(b.rng, 5)
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[i]} = VAR {names[i - 1]}" for i in range(1, hops + 1)]
    span = 1.0 - depth
    statements = [(depth + span * i / (hops + 1), s + ".") for i, s in enumerate(chain)]
    q = f"Question: Find all variables that are assigned the value {value} in the text above."
    head = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n" + q.replace(
        "above", "below"
    )
    text, spans = b.build(head, statements, q, target)
    return text, names, spans


@dataclasses.dataclass(frozen=True)
class TaskKind:
    make: Callable
    metric: str  # "contains_all": every answer string must appear in the output
    max_new_tokens: int


TASKS: dict[str, TaskKind] = {
    "single": TaskKind(single_needle, "contains_all", 32),
    "multikey": TaskKind(multi_key, "contains_all", 32),
    "twohop": TaskKind(two_hop, "contains_all", 32),
    "vt": TaskKind(variable_tracking, "contains_all", 64),
}


def generate(
    task: str, n: int, length: int, count_tokens: Callable[[str], int], seed: int = 0, depth: float | None = None
) -> list[Sample]:
    """n samples of a task at about `length` prompt tokens. depth None: drawn from [0.1, 0.9]. Sample i
    is the same whatever n is, so grids of different sizes share their first samples."""
    kind = TASKS.get(task)
    if kind is None:
        raise KvliteError(f"unknown task '{task}': choose from {', '.join(TASKS)}")
    if length < 256:
        raise KvliteError(f"task length {length} is too short for a haystack: use 256 tokens or more")
    if depth is not None and not 0 <= depth <= 1:
        raise KvliteError(f"--depth must be in [0, 1], got {depth}")
    out = []
    for i in range(n):
        rng = random.Random(f"{seed}/{task}/{length}/{i}")
        d = depth if depth is not None else 0.1 + 0.8 * rng.random()
        text, answers, spans = kind.make(Builder(count_tokens, rng), length, d)
        out.append(Sample(f"{task}/{length}", i, text, answers, kind.metric, kind.max_new_tokens, True, spans))
    return out
