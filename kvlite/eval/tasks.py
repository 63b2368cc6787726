"""Generated long-context tasks, deterministic from a seed and the model's tokenizer: the answer and
the evidence positions are known, so accuracy, fidelity and evidence retention can all be measured
offline. The haystack is real prose (kvlite.eval.haystack: standard-library docstrings).

Layouts follow RULER and the full-cache calibration (what SmolLM2-135M and Qwen2.5-Coder-0.5B
solve with the full cache: docs/design.md, "Calibration")."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

from ..errors import KvliteError
from .haystack import SOURCES

SPLITS = ("tune", "test")


@dataclasses.dataclass(frozen=True)
class Phrasing:
    """How a split states its facts and asks its questions. The tune split (docstring prose, RULER's
    magic numbers) is where defaults are chosen; the test split (news prose, other words, other
    sentence shapes, six-digit codes) is where they are reported, and no choice ever sees it."""

    source: str  # kvlite.eval.haystack.SOURCES
    digits: int
    words: tuple[str, ...]  # key parts for needles
    people: tuple[str, ...]
    places: tuple[str, ...]
    intro: str
    needle: str  # {key} {value}
    question: str  # {key}
    lives: str  # {person} {place}
    place_code: str  # {place} {value}
    hop_head: str  # {question}
    hop_question: str  # {person}
    list_head: str  # {question}
    list_item: str  # {key} {value}
    list_question: str


TUNE = Phrasing(
    source="docstrings",
    digits=7,
    words=(
        "amber", "brisk", "cedar", "dune", "ember", "fable", "glacier", "harbor", "iris", "juniper", "kestrel",
        "lagoon", "meadow", "nimbus", "orchid", "pepper", "quartz", "raven", "saffron", "tundra", "umber", "velvet",
        "willow", "zephyr",
    ),
    people=("Alice", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kofi", "Lena"),
    places=(
        "Lisbon", "Oslo", "Quito", "Hanoi", "Dakar", "Lima", "Perth", "Tunis", "Riga", "Porto", "Minsk", "Accra",
        "Bern", "Cairo", "Delhi", "Kyoto",
    ),
    intro="Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.",
    needle="The special magic number for {key} is: {value}.",
    question="What is the special magic number for {key} mentioned in the provided text?",
    lives="{person} lives in {place}.",
    place_code="The secret code of {place} is {value}.",
    hop_head="Read the text. Some facts about people and cities are hidden in it. Afterwards, answer this "
    "question: {question}",
    hop_question="What is the secret code of the city where {person} lives?",
    list_head="Some lockers and their combinations are listed in the following text. Afterwards, list them "
    "all: {question}",
    list_item="Locker {key} opens with the combination {value}.",
    list_question="List every locker mentioned in the text with its combination, one per line.",
)  # fmt: skip

TEST = Phrasing(
    source="news",
    digits=6,
    words=(
        "Falcon", "Lantern", "Copper", "Meridian", "Bramble", "Sextant", "Pinnacle", "Thistle", "Cobalt", "Harrow",
        "Marlin", "Obsidian", "Paddock", "Quill", "Rosewood", "Sparrow", "Trellis", "Walrus",
    ),
    people=("Marisol", "Thaddeus", "Yusuf", "Beatrix", "Callum", "Odile", "Rafferty", "Sunniva", "Tobias", "Wanjiru"),
    places=(
        "Ambleford", "Corrowick", "Dunmarra", "Eastwold", "Fennimore", "Glenrock", "Hollins Bay", "Kestrelby",
        "Marrowdale", "Norbury", "Pellingham", "Thornvale",
    ),
    intro="The news digest below contains a few access codes among the articles. Keep them in mind: you will "
    "be asked about one of them.",
    needle="Note for the archive: the access code issued to Project {key} is {value}.",
    question="Which access code was issued to Project {key}?",
    lives="Last spring {person} moved to the town of {place}.",
    place_code="Visitors to {place} open the town gate with the code {value}.",
    hop_head="Answer a question about the news digest below; the facts you need are scattered through it. "
    "The question: {question}",
    hop_question="Which code opens the gate of the town that {person} moved to?",
    list_head="Several warehouse crates are described in the news digest below. Afterwards, answer: {question}",
    list_item="Crate {key} was sealed with the tag number {value}.",
    list_question="Give the tag number of every crate mentioned, one crate per line, in the order they appear.",
)  # fmt: skip

PHRASINGS = {"tune": TUNE, "test": TEST}


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
    split: str = "data"  # "tune" or "test" for generated tasks; "data" for a user's files
    question: tuple[int, int] | None = None  # character span of the closing question (None: unknown)
    # A conversation (multi-turn tasks): the user messages in order, each with the answers its reply
    # must contain (none for a turn that only tells something). `prompt` is then the first message.
    turns: list[tuple[str, list[str]]] | None = None
    # What the reply continues (RULER's answer prefix): after the chat template's assistant header,
    # or after the prompt where there is no template (in place of BASE_MODEL_CUE). None: nothing.
    cue: str | None = None


def _code(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def _key(rng: random.Random, taken: set[str], words: tuple[str, ...] = TUNE.words) -> str:
    """Tune keys join two words (amber-quartz); test keys are one capitalized word (Project Falcon)."""
    while True:
        key = f"{rng.choice(words)}-{rng.choice(words)}" if words[0].islower() else rng.choice(words)
        if key not in taken and (key.count("-") == 0 or key.split("-")[0] != key.split("-")[1]):
            taken.add(key)
            return key


class Builder:
    """Fills a prompt with haystack paragraphs up to a target length in tokens and places
    statements at depths (0 = start, 1 = end), recording where each statement lands."""

    def __init__(self, count_tokens: Callable[[str], int], rng: random.Random, phrasing: Phrasing = TUNE,
                 paste: bool = False):  # fmt: skip
        """paste: the document and the closing question only, no instructions before the document."""
        self.count = count_tokens
        self.rng = rng
        self.p = phrasing
        self.paste = paste

    def build(self, head: str, statements: list[tuple[float, str]], tail: str, target: int) -> tuple[str, list]:
        head = "" if self.paste else head
        pool = SOURCES[self.p.source](400)
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
        text = (head + "\n\n" if head else "") + "\n\n".join(paras) + "\n\n" + tail
        spans = []
        for _, s in statements:
            at = text.index(s)
            spans.append((at, at + len(s)))
        return text, spans


def single_needle(b: Builder, target: int, depth: float) -> tuple[str, list[str], list]:
    p = b.p
    key, value = _key(b.rng, set(), p.words), _code(b.rng, p.digits)
    text, spans = b.build(p.intro, [(depth, p.needle.format(key=key, value=value))], p.question.format(key=key), target)
    return text, [value], spans


def multi_key(b: Builder, target: int, depth: float, n_keys: int = 4) -> tuple[str, list[str], list]:
    """n_keys needles of the same form, one asked for: the others are distractors."""
    p = b.p
    taken: set[str] = set()
    needles = [(_key(b.rng, taken, p.words), _code(b.rng, p.digits)) for _ in range(n_keys)]
    asked = b.rng.randrange(n_keys)
    depths = [(depth + i / n_keys) % 1.0 for i in range(n_keys)]
    statements = [(d, p.needle.format(key=k, value=v)) for d, (k, v) in zip(depths, needles)]
    text, spans = b.build(p.intro, statements, p.question.format(key=needles[asked][0]), target)
    return text, [needles[asked][1]], [spans[asked]]


def two_hop(b: Builder, target: int, depth: float) -> tuple[str, list[str], list]:
    """Two facts far apart that must be joined: who lives where (at `depth`), and the code of that
    place (half the text later). The question names neither the place nor the code, and comes first
    as well as last: asked only at the end, both test models answered with the city (docs/design.md,
    "Calibration")."""
    p = b.p
    person, place, code = b.rng.choice(p.people), b.rng.choice(p.places), _code(b.rng, p.digits)
    facts = [
        (depth, p.lives.format(person=person, place=place)),
        ((depth + 0.5) % 1.0, p.place_code.format(place=place, value=code)),
    ]
    q = p.hop_question.format(person=person)
    text, spans = b.build(p.hop_head.format(question=q), facts, q, target)
    return text, [code], spans


def variable_tracking(b: Builder, target: int, depth: float, hops: int = 4) -> tuple[str, list[str], list]:
    """RULER's vt: a chain VAR A = value, VAR B = VAR A, ... spread through the text; the answer is
    every variable of the chain. The question also comes first (Qwen needs it there: docs/design.md,
    "Calibration"). The same wording in both splits (RULER's), over each split's prose."""
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


def list_recall(b: Builder, target: int, depth: float, n_items: int = 6) -> tuple[str, list[str], list]:
    """Decode-heavy: n_items facts spread from `depth` to the end, and an answer that must restate
    every one of them, so the prompt is needed throughout a long generation (the counter-causal
    paper's regime, scaled to what the test models can do). Scored by the share of values recalled."""
    p = b.p
    taken: set[str] = set()
    items = [(_key(b.rng, taken, p.words), _code(b.rng, 4)) for _ in range(n_items)]
    span = 1.0 - depth
    statements = [(depth + span * i / n_items, p.list_item.format(key=k, value=v)) for i, (k, v) in enumerate(items)]
    text, spans = b.build(p.list_head.format(question=p.list_question), statements, p.list_question, target)
    return text, [v for _, v in items], spans


READ = "Please read the document above; I will ask questions about it."


def chat_facts(b: Builder, target: int, depth: float, n_facts: int = 4) -> tuple[str, list[str], list, list]:
    """Multi-turn: a document turn (no question) stating n_facts codes spread through it, then one
    question per turn about each fact in a shuffled order (so one is asked in turn 2, one in the
    last turn). The document turn carries no question: what it keeps must serve questions asked later."""
    p = b.p
    taken: set[str] = set()
    facts = [(_key(b.rng, taken, p.words), _code(b.rng, p.digits)) for _ in range(n_facts)]
    depths = [(depth + i / n_facts) % 1.0 for i in range(n_facts)]
    statements = [(d, p.needle.format(key=k, value=v)) for d, (k, v) in zip(depths, facts)]
    text, spans = b.build(p.intro, statements, READ, target)
    order = list(range(n_facts))
    b.rng.shuffle(order)
    turns = [(text, [])] + [(p.question.format(key=facts[i][0]), [facts[i][1]]) for i in order]
    return text, [v for _, v in facts], spans, turns


def chat_hop(b: Builder, target: int, depth: float) -> tuple[str, list[str], list, list]:
    """Multi-turn, two facts from two turns (LoCoMo's multi-hop spirit): the document says where a
    person lives; a later turn adds the code of that place; the last turn asks for the code of the
    place where the person lives. A distractor question in between keeps the cache moving."""
    p = b.p
    person, place, code = b.rng.choice(p.people), b.rng.choice(p.places), _code(b.rng, p.digits)
    key, value = _key(b.rng, set(), p.words), _code(b.rng, p.digits)
    statements = [(depth, p.lives.format(person=person, place=place)), ((depth + 0.5) % 1.0,
                  p.needle.format(key=key, value=value))]  # fmt: skip
    text, spans = b.build(p.intro, statements, READ, target)
    turns = [
        (text, []),
        (p.question.format(key=key), [value]),
        ("One more fact for later. " + p.place_code.format(place=place, value=code), []),
        (p.hop_question.format(person=person), [code]),
    ]
    return text, [value, code], spans, turns


@dataclasses.dataclass(frozen=True)
class TaskKind:
    make: Callable
    metric: str  # "contains_all": every answer string must appear; "contains_share": the share that does
    max_new_tokens: int
    decode_heavy: bool = False  # the answer restates prompt content all along its generation
    multi_turn: bool = False  # make() also returns the conversation's turns


TASKS: dict[str, TaskKind] = {
    "single": TaskKind(single_needle, "contains_all", 32),
    "multikey": TaskKind(multi_key, "contains_all", 32),
    "twohop": TaskKind(two_hop, "contains_all", 32),
    "vt": TaskKind(variable_tracking, "contains_all", 64),
    "recall": TaskKind(list_recall, "contains_share", 128, decode_heavy=True),
    "chat": TaskKind(chat_facts, "contains_all", 32, multi_turn=True),
    "chat-hop": TaskKind(chat_hop, "contains_all", 32, multi_turn=True),
}


# The second prompt shape (docs/results.md, "Two prompt shapes"): a task's document then its
# question, as a user pastes both into one chat turn (`kvlite generate --chat -f doc.txt`), without
# the instructions the task's own shape opens with. "paste-single" is "single" in that shape: the
# same facts, codes and prose.
PASTE = "paste-"


def task_kind(task: str) -> tuple[TaskKind, bool]:
    """A task name's kind and whether it is in the paste shape; a one-line error for an unknown name."""
    base = task.removeprefix(PASTE)
    kind = TASKS.get(base)
    if kind is None or (base != task and kind.multi_turn):
        names = [*TASKS, *(PASTE + t for t, k in TASKS.items() if not k.multi_turn)]
        raise KvliteError(f"unknown task '{task}': choose from {', '.join(names)}")
    return kind, base != task


def task_label(task: str, length: int, split: str = "tune") -> str:
    """single/2048 on the tune split (as before splits existed), test:single/2048 on the test split."""
    return f"{task}/{length}" if split == "tune" else f"{split}:{task}/{length}"


MIN_LENGTH = 256  # prompt tokens: room for a haystack around the facts and the question


def generate(
    task: str,
    n: int,
    length: int,
    count_tokens: Callable[[str], int],
    seed: int = 0,
    depth: float | None = None,
    split: str = "tune",
) -> list[Sample]:
    """n samples of a task at about `length` prompt tokens, from a split's prose and phrasing. depth
    None: drawn from [0.1, 0.9]. Sample i is the same whatever n is, so grids of different sizes
    share their first samples."""
    kind, paste = task_kind(task)
    if split not in PHRASINGS:
        raise KvliteError(f"unknown split '{split}': choose from {', '.join(PHRASINGS)}")
    if length < MIN_LENGTH:
        raise KvliteError(f"task length {length} is too short for a haystack: use {MIN_LENGTH} tokens or more")
    if depth is not None and not 0 <= depth <= 1:
        raise KvliteError(f"--depth must be in [0, 1], got {depth}")
    out = []
    for i in range(n):
        # the tune split keeps the seeds it had before splits existed: its records stay valid
        # (a paste-shaped sample draws what its task's own shape draws: the same facts and codes)
        base = task.removeprefix(PASTE)
        rng = random.Random(f"{seed}/{base}/{length}/{i}" + ("" if split == "tune" else f"/{split}"))
        d = depth if depth is not None else 0.1 + 0.8 * rng.random()
        made = kind.make(Builder(count_tokens, rng, PHRASINGS[split], paste), length, d)
        text, answers, spans = made[:3]
        tail = text.rindex("\n\n") + 2  # every layout ends with its question after a blank line
        out.append(Sample(task_label(task, length, split), i, text, answers, kind.metric, kind.max_new_tokens, True,
                          spans, split=split, question=None if kind.multi_turn else (tail, len(text)),
                          turns=made[3] if kind.multi_turn else None))  # fmt: skip
    return out
