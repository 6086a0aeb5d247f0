"""KV eviction under a budget (--kv-budget, H2O and SnapKV) against full attention, bundled SmolLM2-135M-Instruct:

- perplexity: WikiText-2 raw test as one long document, windows of a 2,048-token prompt and a continuation; the
  prompt's KV is compressed to the budget after its prefill (one 2,048-token chunk), then the continuation is scored
  from the compressed cache (one chunk: its own tokens stay, nothing of it is evicted before it is scored);
- needle retrieval: a synthetic set (WikiText filler, "The secret number of X is NNNN." at depths 5% to 95%, then
  the question, through the chat template), greedy answer (32 tokens), exact match of the number.

    OMP_NUM_THREADS=1 python benchmarks/kv_budget.py --out docs/kv-budget.md

Quality only: no timings, so no CPU record is needed (one thread: on a shared 2-core machine two OpenMP threads ran a
2k-token prefill 10x slower). Each request runs alone (max_num_seqs 1) so the prompt's chunking is the same for every
setting.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

from leanlm import LLM, SamplingParams
from leanlm.analysis.eval import Window, perplexity, read_text
from leanlm.analysis.host import describe_machine
from leanlm.analysis.markdown import replace_section
from leanlm.data import wikitext2_test_path
from leanlm.loading.registry import DEFAULT_MODEL

POLICIES = ("h2o", "snapkv")
SUBJECTS = ("Alice", "the red door", "Captain Moss", "the old lighthouse", "Professor Lin", "the green boat",
            "Mr. Okafor", "the silver key", "the north tower", "Doctor Reyes")  # fmt: skip


def ppl_windows(ids: list[int], num_windows: int, prompt_len: int, continuation: int) -> list[Window]:
    """Windows spread over the whole document: each a prompt of prompt_len tokens (context) and `continuation`
    scored tokens."""
    size = prompt_len + continuation
    stride = (len(ids) - size) // max(1, num_windows - 1)
    return [Window(tuple(ids[i * stride : i * stride + size]), prompt_len) for i in range(num_windows)]


def needle_cases(text: str, tokenizer, num_cases: int, filler_tokens: int, seed: int = 0) -> list[tuple[str, str]]:
    """(user message, the number) pairs: WikiText paragraphs of about filler_tokens tokens with the needle sentence
    between two paragraphs at depths spread over 5% .. 95%."""
    rng = random.Random(seed)
    paragraphs = [p.strip() for p in text.split("\n") if len(p.split()) > 20 and not p.strip().startswith("=")]
    cases = []
    for i in range(num_cases):
        subject, number = SUBJECTS[i % len(SUBJECTS)], str(rng.randrange(1000, 10000))
        depth = 0.05 + 0.9 * i / max(1, num_cases - 1)
        start = rng.randrange(0, len(paragraphs) - 400)
        chosen, length = [], 0
        while length < filler_tokens:
            chosen.append(paragraphs[start + len(chosen)])
            length += len(tokenizer.encode(chosen[-1])) + 1
        chosen.insert(round(depth * len(chosen)), f"The secret number of {subject} is {number}.")
        body = "\n".join(chosen)
        question = f"What is the secret number of {subject}? Answer with the number only."
        cases.append((f"Read the text and remember the secret number.\n\n{body}\n\n{question}", number))
    return cases


def settings(prompt_len: int, fractions: list[float]) -> list[tuple[str, int | None]]:
    """(policy, budget tokens) per row: full attention first."""
    return [("full", None)] + [(p, round(f * prompt_len)) for f in fractions for p in POLICIES]


def engine(policy: str, budget: int | None, batch_tokens: int) -> LLM:
    options = {} if budget is None else dict(kv_budget=budget, kv_eviction=policy)
    return LLM(DEFAULT_MODEL, max_num_batched_tokens=batch_tokens, max_num_seqs=1, **options)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=6, help="WikiText-2 windows scored")
    ap.add_argument("--prompt-len", type=int, default=2048, help="tokens compressed to the budget")
    ap.add_argument("--continuation", type=int, default=512, help="tokens scored after the compressed prompt")
    ap.add_argument("--needles", type=int, default=30, help="needle-retrieval cases")
    ap.add_argument("--budgets", default="0.1,0.25,0.5,1.0", help="budgets as fractions of --prompt-len")
    ap.add_argument("--out", default=None, help="markdown file whose kv-budget-results section is rewritten")
    args = ap.parse_args()
    fractions = [float(f) for f in args.budgets.split(",")]
    tokenizer = LLM(DEFAULT_MODEL).get_tokenizer()
    text = read_text(wikitext2_test_path())
    windows = ppl_windows(tokenizer.encode(text), args.windows, args.prompt_len, args.continuation)
    cases = needle_cases(text, tokenizer, args.needles, args.prompt_len - 150)
    greedy = SamplingParams(max_tokens=32, temperature=0.0)  # "The secret number of X is N." then digit tokens
    rows, base = [], None
    for policy, budget in settings(args.prompt_len, fractions):
        started = time.perf_counter()
        ppl = perplexity(engine(policy, budget, args.prompt_len), windows, use_tqdm=False).perplexity
        llm = engine(policy, budget, 2 * args.prompt_len)  # each needle prompt in one chunk
        outputs = llm.chat([[{"role": "user", "content": m}] for m, _ in cases], greedy, use_tqdm=False)
        accuracy = 100 * sum(n in o.outputs[0].text for (_, n), o in zip(cases, outputs)) / len(cases)
        base = base or (ppl, accuracy)
        share = "100% (no budget)" if budget is None else f"{budget} ({100 * budget / args.prompt_len:.0f}%)"
        rows.append([policy, share, f"{ppl:.3f}", f"{100 * (ppl / base[0] - 1):+.2f}%", f"{accuracy:.1f}%",
                     f"{accuracy - base[1]:+.1f}"])  # fmt: skip
        print(rows[-1], f"{time.perf_counter() - started:.0f} s", flush=True)
    lengths = [len(tokenizer.encode(m)) for m, _ in cases]
    header = ["policy", "KV budget, tokens (of the 2k prompt)", "perplexity", "vs full", "needle accuracy",
              "vs full, points"]  # fmt: skip
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]
    body = (
        f"Machine: {describe_machine()} (quality only: no timings).\n\nCommand: `OMP_NUM_THREADS=1 python "
        f"benchmarks/kv_budget.py "
        f"--windows {args.windows} --prompt-len {args.prompt_len} --continuation {args.continuation} --needles "
        f"{args.needles} --budgets {args.budgets}`. Model: {DEFAULT_MODEL} (bundled GGUF). Perplexity: WikiText-2 "
        f"raw test, {len(windows)} windows spread over the document, each a {args.prompt_len}-token prompt compressed "
        f"to the budget, then {args.continuation} scored tokens ({len(windows) * args.continuation} in all). Needles: "
        f"{len(cases)} cases of {min(lengths)}-{max(lengths)} prompt tokens, the needle at depths 5%-95%, greedy "
        f"answer of at most 32 tokens containing the number. A budgeted request holds at most budget + 16 tokens "
        f"(one block) between compactions.\n\n" + "\n".join(table)
    )
    print(body)
    if args.out:
        replace_section(Path(args.out), "kv-budget-results", body)
    assert all(math.isfinite(float(r[2])) for r in rows)


if __name__ == "__main__":
    main()
