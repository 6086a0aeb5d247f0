"""Expert capacity and batch priority routing on a MoE checkpoint: drop rate and perplexity at decode batch sizes.

    python benchmarks/moe_capacity.py --model PATH --doc docs/moe.md

B windows of WikiText-2 raw test are prefilled (a prefix of P tokens each, no capacity), then decoded together with
teacher forcing for S steps: each step is one engine-style decode step of B tokens, the unit a capacity counts
over (capacity = ceil(factor x B x k / E) per expert and step). The NLL of every decoded token gives the
perplexity; the layers' counters give the drop rate. Every capacity setting restarts from the same prefilled KV
cache, so the rows of one batch size score the same tokens. Quality only: no timing, so no contamination check.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from leanlm.analysis.eval import read_text
from leanlm.analysis.host import describe_machine
from leanlm.analysis.markdown import replace_section
from leanlm.config.moe import RoutingPolicy
from leanlm.formats import read_checkpoint
from leanlm.model.context import ExpertRouting, build_forward_context, forward_context
from leanlm.model.llama import build_model
from leanlm.model.moe import moe_blocks
from leanlm.model.paged_kv import PagedKVCache

BLOCK = 16
POLICIES = [(None, False)] + [(cf, bpr) for cf in (0.5, 1.0, 1.25, 2.0) for bpr in (False, True)]


def windows(tokenizer, text: str, count: int, length: int) -> torch.Tensor:
    """[count, length] token ids: consecutive, non-overlapping pieces of the text."""
    ids = tokenizer.encode(text)
    if len(ids) < count * length:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {count} x {length}")
    stride = len(ids) // count
    return torch.tensor([ids[i * stride : i * stride + length] for i in range(count)])


def prefill(model, cache: PagedKVCache, seqs: torch.Tensor, prefix: int) -> list[list[int]]:
    blocks_per = math.ceil(seqs.shape[1] / BLOCK)
    tables = [list(range(b * blocks_per, (b + 1) * blocks_per)) for b in range(seqs.shape[0])]
    for b in range(seqs.shape[0]):
        ctx = build_forward_context([prefix], [prefix], [tables[b][: math.ceil(prefix / BLOCK)]], cache)
        with forward_context(ctx), torch.no_grad():
            model(seqs[b, :prefix], torch.arange(prefix))
    return tables


def decode(
    model, cache: PagedKVCache, seqs: torch.Tensor, tables, prefix: int, policy: RoutingPolicy
) -> tuple[float, int]:
    """Summed NLL of tokens prefix+1 .. L-1, decoding B tokens a step under `policy`; and how many were scored."""
    batch, length = seqs.shape
    nll, scored = 0.0, 0
    for pos in range(prefix, length - 1):
        ctx = build_forward_context([1] * batch, [pos + 1] * batch, [t[: math.ceil((pos + 1) / BLOCK)] for t in tables],
                                    cache, routing=ExpertRouting(policy))  # fmt: skip
        with forward_context(ctx), torch.no_grad():
            hidden = model(seqs[:, pos], torch.full((batch,), pos))
            logits = model.compute_logits(hidden).float()
        nll += float(F.cross_entropy(logits, seqs[:, pos + 1], reduction="sum"))
        scored += batch
    return nll, scored


def counters(model) -> tuple[int, int]:
    blocks = moe_blocks(model)
    return sum(b.stats.assignments for b in blocks), sum(b.stats.dropped for b in blocks)


def measure(model, tokenizer, text: str, batch: int, tokens: int, prefix: int) -> list[dict]:
    steps = max(8, tokens // batch)
    seqs = windows(tokenizer, text, batch, prefix + steps + 1)
    cfg = model.config
    num_blocks = batch * math.ceil(seqs.shape[1] / BLOCK)
    cache = PagedKVCache.allocate(cfg.num_hidden_layers, num_blocks, cfg.num_key_value_heads, BLOCK, cfg.head_dim,
                                  model.model.norm.weight.dtype, "cpu")  # fmt: skip
    tables = prefill(model, cache, seqs, prefix)
    saved = cache.kv.clone()
    rows = []
    for factor, bpr in tqdm(POLICIES, desc=f"batch {batch}", unit="policy"):
        cache.kv.copy_(saved)
        before = counters(model)
        nll, scored = decode(model, cache, seqs, tables, prefix, RoutingPolicy(factor, bpr))
        after = counters(model)
        assigned, dropped = after[0] - before[0], after[1] - before[1]
        rows.append(dict(batch=batch, factor=factor, bpr=bpr, ppl=math.exp(nll / scored), scored=scored,
                         drop=dropped / assigned if assigned else 0.0))  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def report(rows: list[dict], args, moe) -> str:
    lines = [
        f"`{args.model}` ({moe.num_experts} experts, top-{moe.top_k}, {moe.scoring}), bf16, WikiText-2 raw test: "
        f"B windows prefilled with {args.prefix} tokens, then decoded B tokens a step with teacher forcing, about "
        f"{args.tokens} scored tokens per batch size. Capacity per expert and step = ceil(factor x B x k / E); "
        f"'plain' gives it to first choices before second ones in token order (Switch / GShard), BPR to the tokens "
        f"the router is surest of (V-MoE). {describe_machine()}. Command: `python benchmarks/moe_capacity.py "
        f"--model {args.model} --batches {' '.join(map(str, args.batches))} --tokens {args.tokens}`.",
        "",
        "| B | capacity factor | routing | dropped assignments | perplexity | vs no capacity |",
        "|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        base = next(x for x in rows if x["batch"] == r["batch"] and x["factor"] is None)
        factor = "none" if r["factor"] is None else f"{r['factor']:g}"
        routing = "-" if r["factor"] is None else ("BPR" if r["bpr"] else "plain")
        lines.append(f"| {r['batch']} | {factor} | {routing} | {r['drop']:.1%} | {r['ppl']:.3f} "
                     f"| {r['ppl'] / base['ppl'] - 1:+.1%} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a MoE checkpoint (directory or GGUF)")
    parser.add_argument("--text", default="../shared/data/wikitext-2-raw/wiki.test.raw")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--tokens", type=int, default=1024, help="scored tokens per batch size (about)")
    parser.add_argument("--prefix", type=int, default=64, help="prefilled tokens per window")
    parser.add_argument("--doc", type=Path, default=None, help="markdown file whose capacity section is replaced")
    args = parser.parse_args()
    torch.manual_seed(0)
    ckpt = read_checkpoint(args.model, progress=False)
    if ckpt.config.moe is None:
        raise SystemExit(f"{args.model} is a dense model: give a mixture-of-experts checkpoint")
    model = build_model(ckpt.config, ckpt.state_dict, torch.bfloat16, quantized=ckpt.quantized)
    text = read_text(args.text)
    rows = [r for batch in args.batches for r in measure(model, ckpt.tokenizer, text, batch, args.tokens, args.prefix)]
    table = report(rows, args, ckpt.config.moe)
    print(table)
    if args.doc is not None:
        replace_section(args.doc, "capacity", table)


if __name__ == "__main__":
    main()
