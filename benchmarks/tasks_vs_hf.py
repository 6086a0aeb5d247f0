"""Task accuracies of LeanLM (the engine's batched prompt-logprob path) next to a plain HF transformers loop
(one forward per (context, continuation) pair), same model, float32, same items and tokenization.

    python benchmarks/tasks_vs_hf.py --limit 200
"""

from __future__ import annotations

import argparse

import torch
from tqdm.auto import tqdm

from leanlm import LLM
from leanlm.analysis.host import describe_machine
from leanlm.analysis.tasks import TASKS, PairScore, choose, encode_pair, evaluate_items, parse_task_names
from leanlm.loading.registry import DEFAULT_MODEL, resolve_model


def hf_scores(hf_model, tokenizer, pairs) -> list[PairScore]:
    scores = []
    for context, continuation in pairs:
        ctx, cont = encode_pair(tokenizer, context, continuation)
        with torch.inference_mode():
            logits = hf_model(torch.tensor([ctx + cont])).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)[len(ctx) - 1 : -1]  # row i scores continuation token i
        targets = torch.tensor(cont)
        scores.append(
            PairScore(
                float(lp.gather(1, targets.unsqueeze(1)).sum()),
                bool((lp.argmax(dim=-1) == targets).all()),
                len(continuation),
            )
        )
    return scores


def main() -> None:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--limit", type=int, default=200)
    args = parser.parse_args()
    names = parse_task_names(args.tasks)
    path = resolve_model(DEFAULT_MODEL)
    llm = LLM(DEFAULT_MODEL, dtype="float32", device="cpu", progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    print(f"{DEFAULT_MODEL}, float32, zero-shot, first {args.limit} items per task; {describe_machine()}\n")
    print("| task | items | metric | LeanLM | HF transformers | items with the same choice |")
    print("|---|---:|---|---:|---:|---:|")
    for name in names:
        items = TASKS[name].load(args.limit)
        ours = evaluate_items(llm, name, items, use_tqdm=False)
        flat = hf_scores(
            hf, llm.tokenizer, tqdm([p for item in items for p in item.pairs], desc=f"HF {name}", leave=False)
        )
        per_item, start = [], 0
        for item in items:
            per_item.append(flat[start : start + len(item.pairs)])
            start += len(item.pairs)
        for metric, value in ours.metrics.items():
            chosen = [choose(s, metric) for s in per_item]
            gold = [1 if metric == "greedy" else item.label for item in items]
            hf_value = sum(c == g for c, g in zip(chosen, gold)) / len(items)
            same = sum(a == b for a, b in zip(chosen, ours.predictions[metric]))
            shown = "acc (last word greedy)" if metric == "greedy" else metric
            print(
                f"| {name} | {len(items)} | {shown} | {value:.4f} | {hf_value:.4f} | {same}/{len(items)} |", flush=True
            )


if __name__ == "__main__":
    main()
