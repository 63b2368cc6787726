"""LongBench-format JSONL (fields context, input, answers, all_classes, length, dataset) with
LongBench's own prompt templates, generation lengths and metrics (THUDM/LongBench config/ and
eval.py), so a user with the real data gets comparable numbers."""

from __future__ import annotations

import json
import pathlib

from ..errors import KvliteError
from ..limits import kind_of
from . import ruler
from .metrics import METRICS
from .tasks import Sample

_QA_PASSAGES = (
    "Answer the question based on the given passages. Only give me the answer and do not output any other words."
    "\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give "
    "me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
)
PROMPTS = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the question "
        "as concisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: "
        "{context}\n\nNow, answer the question based on the story as concisely as you can, using a single phrase if "
        "possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "qasper": (
        "You are given a scientific article and a question. Answer the question as concisely as you can, using a "
        "single phrase or sentence if possible. If the question cannot be answered based on the information in the "
        'article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". '
        "Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as "
        "concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered "
        'based on the information in the article, write "unanswerable". If the question is a yes/no question, answer '
        '"yes", "no", or "unanswerable". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:'
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the "
        "above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "hotpotqa": _QA_PASSAGES,
    "2wikimqa": _QA_PASSAGES,
    "musique": _QA_PASSAGES,
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}"
        "\n\nNow, write a one-page summary of the report.\n\nSummary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. Answer the query in one "
        "or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting transcript "
        "in one or more sentences.\n\nQuery: {input}\nAnswer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, "
        "write a one-page summary of all the news.\n\nSummary:"
    ),
    "trec": (
        "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}"
    ),
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any other words. "
        "The following are some examples.\n\n{context}\n\n{input}"
    ),
    "samsum": (
        "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}"
    ),
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read "
        "these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other "
        "words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final count of "
        "unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, "
        "2, 3, and so on.\n\nThe final answer is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract "
        "is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph "
        'that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", etc.\n\nThe answer '
        "is: "
    ),
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}
MAX_NEW_TOKENS = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "hotpotqa": 32, "2wikimqa": 32, "musique": 32,
    "gov_report": 512, "qmsum": 512, "multi_news": 512, "trec": 64, "triviaqa": 32, "samsum": 128,
    "passage_count": 32, "passage_retrieval_en": 32, "lcc": 64, "repobench-p": 64,
}  # fmt: skip
METRIC = {
    "narrativeqa": "qa_f1", "qasper": "qa_f1", "multifieldqa_en": "qa_f1", "hotpotqa": "qa_f1", "2wikimqa": "qa_f1",
    "musique": "qa_f1", "gov_report": "rouge", "qmsum": "rouge", "multi_news": "rouge", "trec": "classification",
    "triviaqa": "qa_f1", "samsum": "rouge", "passage_count": "count", "passage_retrieval_en": "retrieval",
    "lcc": "code_sim", "repobench-p": "code_sim",
}  # fmt: skip
# LongBench's pred.py feeds these raw (few-shot and code completion), and eval.py scores only their
# first output line.
NO_CHAT = {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}
FIRST_LINE = {"trec", "triviaqa", "samsum", "lsht"}
CHINESE = {"multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh"}


def check_dataset(name: str) -> None:
    """A LongBench dataset kvlite can score, or a RULER task as ruler_<task>; a one-line error otherwise."""
    if name.startswith("ruler_"):
        ruler.family(name.removeprefix("ruler_"))
        return
    if name in CHINESE:
        raise KvliteError(f"dataset '{name}' is Chinese: its metrics need jieba segmentation, which kvlite lacks")
    if name not in PROMPTS:
        raise KvliteError(f"unknown LongBench dataset '{name}': choose from {', '.join(sorted(PROMPTS))} (or RULER's "
                          "as ruler_<task>)")  # fmt: skip


def _dataset_of(row: dict, path: pathlib.Path, default: str | None) -> str:
    name = row.get("dataset") or default or path.stem.removesuffix("_e")
    if not isinstance(name, str):
        raise KvliteError(f"field dataset must be a string, got {kind_of(name)}")
    check_dataset(name)
    return name


def load(path: str | pathlib.Path, dataset: str | None = None, metric: str | None = None) -> tuple[list, list]:
    """Samples of a LongBench-format JSONL, and one error message per line that could not be used
    (malformed JSON, missing fields, unknown dataset or metric), each naming its line."""
    path = pathlib.Path(path)
    if path.is_dir():
        raise KvliteError(f"--data {path} is a directory: name a JSONL file")
    if path.exists() and not path.is_file():
        raise KvliteError(f"--data {path} is not a regular file (a device or a pipe): name a JSONL file")
    if not path.is_file():
        raise KvliteError(f"data file not found: {path}")
    if metric is not None and metric not in METRICS:
        raise KvliteError(f"unknown metric '{metric}': choose from {', '.join(METRICS)}")
    samples, errors = [], []
    try:
        lines = path.read_bytes().split(b"\n")
    except OSError as e:
        raise KvliteError(f"cannot read data file {path}: {e.strerror or e}") from None
    for lineno, raw in enumerate(lines, 1):
        if raw.strip():
            try:
                samples.append(_sample(raw, lineno, path, dataset, metric))
            except KvliteError as e:
                errors.append(f"{path}:{lineno}: {e}")
    return samples, errors


def _sample(raw: bytes, lineno: int, path: pathlib.Path, dataset: str | None, metric: str | None) -> Sample:
    try:
        row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise KvliteError(f"not valid UTF-8 (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise KvliteError(f"not valid JSON ({e.msg})") from None
    except RecursionError:
        raise KvliteError("JSON nested too deep") from None
    if not isinstance(row, dict):
        raise KvliteError("a line must be a JSON object")
    if "outputs" in row or str(row.get("dataset") or dataset or "").startswith("ruler_"):
        if "input" not in row or "outputs" not in row:
            raise KvliteError("missing field(s) input, outputs of a RULER line")
        return ruler.read_line(row, lineno, path, dataset, metric)
    missing = [k for k in ("context", "input", "answers") if k not in row]
    if missing:
        raise KvliteError(f"missing field(s) {', '.join(missing)}")
    for key in ("context", "input"):
        if not isinstance(row[key], str):
            raise KvliteError(f"field {key} must be a string, got {kind_of(row[key])}")
    answers = row["answers"] if isinstance(row["answers"], list) else [row["answers"]]
    if not answers or not all(isinstance(a, (str, int, float)) and not isinstance(a, bool) for a in answers):
        raise KvliteError(f"field answers must be a string or a non-empty list of strings, got "
                          f"{kind_of(row['answers'])}")  # fmt: skip
    classes = row.get("all_classes")
    if classes is not None and not (isinstance(classes, list) and all(isinstance(c, str) for c in classes)):
        raise KvliteError(f"field all_classes must be a list of strings or null, got {kind_of(classes)}")
    name = _dataset_of(row, path, dataset)
    m = metric or row.get("metric") or METRIC[name]
    if m not in METRICS:
        raise KvliteError(f"unknown metric '{m}': choose from {', '.join(METRICS)}")
    prompt = PROMPTS[name].format(context=row["context"], input=row["input"])
    return Sample(name, lineno, prompt, [str(a) for a in answers], m, MAX_NEW_TOKENS[name],
                  chat=name not in NO_CHAT, all_classes=classes)  # fmt: skip


def postprocess(sample: Sample, prediction: str) -> str:
    return prediction.lstrip("\n").split("\n")[0] if sample.task in FIRST_LINE else prediction
