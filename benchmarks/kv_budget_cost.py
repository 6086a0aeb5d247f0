"""What H2O's and SnapKV's scoring cost (--kv-budget): prefill time of a WikiText-2 prompt and decode time per token
after it, full attention against each policy, on the bundled SmolLM2-135M-Instruct.

    OMP_NUM_THREADS=1 python benchmarks/kv_budget_cost.py --out docs/kv-budget.md

Each repetition records the CPU share other processes took (/proc/stat); repetitions above --max-other-cpu are
reported as contaminated and left out of the medians.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from leanlm import LLM, SamplingParams
from leanlm.analysis.eval import read_text
from leanlm.analysis.host import CpuMonitor, describe_machine
from leanlm.analysis.markdown import replace_section
from leanlm.data import wikitext2_test_path
from leanlm.loading.registry import DEFAULT_MODEL


def timed(llm: LLM, prompt: list[int], num_decode: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds per token) of one request, from its metrics."""
    params = SamplingParams(max_tokens=num_decode + 1, temperature=0.0, ignore_eos=True)
    metrics = llm.generate([prompt], params, use_tqdm=False)[0].metrics
    prefill = metrics.first_token_time - metrics.first_scheduled_time
    return prefill, (metrics.finished_time - metrics.first_token_time) / num_decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--decode", type=int, default=64, help="decode steps timed after the prompt")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-other-cpu", type=float, default=0.10)
    ap.add_argument("--out", default=None, help="markdown file whose kv-budget-cost section is rewritten")
    args = ap.parse_args()
    settings = [("full", {}), *((p, dict(kv_budget=args.budget, kv_eviction=p)) for p in ("snapkv", "h2o"))]
    rows = []
    for name, options in settings:
        # no prefix cache: every repetition prefills the whole prompt, as a budgeted request always does
        llm = LLM(DEFAULT_MODEL, max_num_batched_tokens=4096, enable_prefix_caching=False, **options)
        prompt = llm.get_tokenizer().encode(read_text(wikitext2_test_path()))[: args.prompt_len]
        timed(llm, prompt[:64], 4)  # warm-up: kernels built, caches touched
        reps = []
        for _ in range(args.reps):
            with CpuMonitor() as monitor:
                prefill, decode = timed(llm, prompt, args.decode)
            reps.append((prefill, decode, monitor.sample))
        clean = [r for r in reps if not r[2].is_contaminated(args.max_other_cpu)]
        medians = [statistics.median(r[i] for r in clean) if clean else float("nan") for i in (0, 1)]
        shares = ", ".join(f"{r[2].other_share:.0%}" for r in reps)
        budget = "-" if name == "full" else str(args.budget)
        rows.append([name, budget, f"{medians[0]:.2f}", f"{1000 * medians[1]:.1f}", f"{len(clean)} of {len(reps)}",
                     shares, f"{min(r[0] for r in reps):.2f}", f"{1000 * min(r[1] for r in reps):.1f}"])  # fmt: skip
        print(rows[-1], flush=True)
    header = ["policy", "budget", "prefill s (clean median)", "decode ms/token (clean median)", "clean reps",
              "other CPU per rep", "prefill s (best of all)", "decode ms/token (best of all)"]  # fmt: skip
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]
    body = (
        f"Machine: {describe_machine()}.\n\nCommand: `OMP_NUM_THREADS=1 python benchmarks/kv_budget_cost.py "
        f"--prompt-len {args.prompt_len} --budget {args.budget} --decode {args.decode} --reps {args.reps}`: one "
        f"{args.prompt_len}-token WikiText-2 prompt, then {args.decode} greedy tokens, KV budget {args.budget} tokens. "
        f"A repetition is clean when other processes took at most {args.max_other_cpu:.0%} of the CPUs.\n\n"
        + "\n".join(table)
    )
    print(body)
    if args.out:
        replace_section(Path(args.out), "kv-budget-cost", body)


if __name__ == "__main__":
    main()
