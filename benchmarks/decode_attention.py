"""Paged decode attention alone, as a batched decode step finds it: `--requests` requests of `--context` tokens
(SmolLM2's 9 query / 3 KV heads of 64), one query token each, blocks of 16 tokens in a shuffled order.

Then prompt chunks (`--chunks PREFIX:CHUNK,...`, one request): the CPU backend, which runs each prompt token as a
row of the same kernel, against the reference backend's gather + SDPA path, hot, ms per layer.

"cold": every call reads another layer's cache (`--layers` of them, 16 MB a layer at 128 x 160 tokens), so the
KV comes from DRAM as in a real step, where the other 29 layers ran in between; "hot": the same layer again and
again (the cache in L2/L3). bf16 and int8 caches. Milliseconds per layer, best of `--reps`.

    python benchmarks/decode_attention.py
"""

from __future__ import annotations

import argparse
import time

import torch

from leanlm.analysis.host import describe_machine
from leanlm.kernels import paged_attention
from leanlm.model.attention import CpuAttentionBackend, TorchAttentionBackend
from leanlm.model.context import build_forward_context
from leanlm.model.paged_kv import PagedKVCache

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def caches(layers: int, num_blocks: int, int8: bool, gen: torch.Generator) -> list[tuple]:
    shape = (num_blocks, KV_HEADS, BLOCK, HEAD_DIM)
    out = []
    for _ in range(layers):
        if int8:
            k, v = (torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8) for _ in range(2))
            ks, vs = (torch.rand(shape[:-1], generator=gen) / 100 for _ in range(2))
            out.append((k, v, ks, vs))
        else:
            out.append(tuple(torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(2)))
    return out


def ms_per_layer(call, layers: list[tuple], cold: bool, reps: int) -> float:
    order = list(range(len(layers))) if cold else [0] * len(layers)
    for i in order:  # warm-up pass
        call(layers[i])
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in order:
            call(layers[i])
        best = min(best, (time.perf_counter() - t0) / len(order))
    return best * 1e3


def prompt_chunk_ms(prefix: int, chunk: int, reps: int, gen: torch.Generator) -> tuple[float, float]:
    """(SDPA reference ms, kernel rows ms) for one request computing `chunk` tokens after `prefix` cached ones."""
    seq_len = prefix + chunk
    num_blocks = -(-seq_len // BLOCK)
    cache = PagedKVCache.allocate(1, num_blocks, KV_HEADS, BLOCK, HEAD_DIM, torch.bfloat16, "cpu")
    kv = cache.layer(0)
    kv.k_cache.copy_(torch.randn(kv.k_cache.shape, generator=gen))
    kv.v_cache.copy_(torch.randn(kv.v_cache.shape, generator=gen))
    blocks = torch.randperm(num_blocks, generator=gen).tolist()
    ctx = build_forward_context([chunk], [seq_len], [blocks], cache)
    q = torch.randn(chunk, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    new = [c.view(-1, HEAD_DIM)[ctx.kv_write_index].view(chunk, KV_HEADS, HEAD_DIM) for c in (kv.k_cache, kv.v_cache)]
    out = []
    for backend in (TorchAttentionBackend(), CpuAttentionBackend()):
        call = lambda b=backend: b.attend(q, *new, kv, HEAD_DIM**-0.5, ctx)  # noqa: E731
        out.append(ms_per_layer(lambda _: call(), [None], False, reps))
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunks", default="0:24,0:512,0:2048,1024:32,1024:512,4096:16", help="PREFIX:CHUNK,...")
    args = ap.parse_args()
    if not paged_attention.is_available():
        raise SystemExit("the native paged attention kernel is unavailable on this machine")
    gen = torch.Generator().manual_seed(0)
    per_request = -(-args.context // BLOCK)
    num_blocks = args.requests * per_request
    tables = torch.randperm(num_blocks, generator=gen).view(args.requests, per_request).contiguous()
    lens = torch.full((args.requests,), args.context, dtype=torch.int64)
    q = torch.randn(args.requests, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    scale = HEAD_DIM**-0.5

    def bf16(layer):
        paged_attention.paged_decode_attention(q, *layer, tables, lens, args.context, scale)

    def int8(layer):
        paged_attention.paged_decode_attention_int8(q, *layer, tables, lens, args.context, scale)

    print(f"Machine: {describe_machine()}.\n")
    shape = f"{args.requests} requests x {args.context} tokens, {HEADS} / {KV_HEADS} heads of {HEAD_DIM}"
    print(f"{shape}, ms per layer:\n")
    print("| cache | cold (DRAM) | hot | KV GB/s, cold |\n|---|---:|---:|---:|")
    for name, call, element in (("bf16", bf16, 2), ("int8", int8, 1)):
        layers = caches(args.layers, num_blocks, name == "int8", gen)
        cold, hot = (ms_per_layer(call, layers, c, args.reps) for c in (True, False))
        kv_bytes = 2 * args.requests * args.context * KV_HEADS * HEAD_DIM * element
        print(f"| {name} | {cold:.3f} | {hot:.3f} | {kv_bytes / cold / 1e6:.1f} |")
    print("\nPrompt chunks, one request, bf16 cache, hot, ms per layer:\n")
    print("| cached prefix | chunk | gather + SDPA | kernel rows | speed-up |\n|---:|---:|---:|---:|---:|")
    for spec in filter(None, args.chunks.split(",")):
        prefix, chunk = map(int, spec.split(":"))
        sdpa, rows = prompt_chunk_ms(prefix, chunk, args.reps, gen)
        print(f"| {prefix} | {chunk} | {sdpa:.2f} | {rows:.2f} | {sdpa / rows:.1f}x |")


if __name__ == "__main__":
    main()
