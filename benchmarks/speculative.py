"""Speculative decoding and parallel sampling on real models, in one run on this machine.

    python benchmarks/speculative.py --doc docs/decoding.md

1. Batch-1 latency per proposer (prompt lookup, lookahead, a draft model, self-speculation) on real prompts:
   code editing, code completion, extractive text and open chat; greedy, up to 128 tokens (EOS may stop them),
   prefix caching off. Speedup = the plain engine's wall time / the speculative one's for the same tokens
   (checked identical), for the whole request and for its decode phase (the target's prefill left out).
   SmolLM2-135M (self-speculation, its int4 copy as draft) and the Qwen2.5-Coder pair (0.5B drafting for 1.5B).
   Then the terms of the cost model behind those speedups: the Qwen target's step time when it verifies k drafts
   (1 + k rows) and a draft step's, over a plain decode step; and how often SmolLM2's early exits (first K
   layers, final norm and head) agree with the whole model, against what their steps cost.
2. Batches: 16 requests at once, plain vs prompt lookup with the engine's batch-size switch (on by default at
   more than 8 requests) vs prompt lookup forced on.
3. KV memory of n = 4 samples over a 512-token prompt vs four independent requests.
Each timed repetition records the CPU share other processes took (/proc/stat); contaminated ones are discarded.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from leanlm.analysis.bench import median
from leanlm.analysis.host import CpuMonitor, describe_machine
from leanlm.analysis.markdown import replace_section
from leanlm.compress import RTNConfig, compress
from leanlm.config import EngineConfig
from leanlm.data import wikitext2_test_path
from leanlm.engine import LLMEngine
from leanlm.formats import save_checkpoint
from leanlm.formats.checkpoint import Checkpoint
from leanlm.formats.stored import read_checkpoint
from leanlm.llm import LLM
from leanlm.model.context import build_forward_context, forward_context
from leanlm.model.llama import build_model
from leanlm.model.paged_kv import PagedKVCache
from leanlm.sampling_params import SamplingParams

WIKITEXT = wikitext2_test_path()  # packaged with leanlm (leanlm/data)
SMOL, QWEN_SMALL, QWEN = "smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"

CODE = """import json
from dataclasses import dataclass


@dataclass
class Order:
    order_id: int
    customer: str
    items: list
    total: float
    status: str


def load_orders(path):
    with open(path) as f:
        rows = json.load(f)
    orders = []
    for row in rows:
        orders.append(Order(row["order_id"], row["customer"], row["items"], row["total"], row["status"]))
    return orders


def filter_by_status(orders, status):
    result = []
    for order in orders:
        if order.status == status:
            result.append(order)
    return result


def total_by_customer(orders):
    totals = {}
    for order in orders:
        totals[order.customer] = totals.get(order.customer, 0.0) + order.total
    return totals
"""


# Held-out code-edit workload (`--workload edits`): a module that is not CODE, and five edits of it. The reply
# copies most of the module, and each edit breaks the copy somewhere: where prompt lookup loses its place.
EDIT_CODE = """import re
from collections import Counter

LINE = re.compile(
    r'(?P<ip>\\S+) - - \\[(?P<time>[^\\]]+)\\] "(?P<method>\\w+) (?P<path>\\S+)[^"]*" '
    r"(?P<status>\\d+) (?P<size>\\S+)"
)


def parse_line(line):
    match = LINE.match(line)
    if match is None:
        return None
    fields = match.groupdict()
    fields["status"] = int(fields["status"])
    fields["size"] = 0 if fields["size"] == "-" else int(fields["size"])
    return fields


def read_log(path):
    entries = []
    with open(path) as handle:
        for line in handle:
            entry = parse_line(line)
            if entry is not None:
                entries.append(entry)
    return entries


def status_counts(entries):
    counts = Counter()
    for entry in entries:
        counts[entry["status"]] += 1
    return counts


def bytes_per_path(entries, min_status=200, max_status=299):
    totals = {}
    for entry in entries:
        if min_status <= entry["status"] <= max_status:
            totals[entry["path"]] = totals.get(entry["path"], 0) + entry["size"]
    return totals


def top_paths(entries, limit=10):
    ranked = sorted(bytes_per_path(entries).items(), key=lambda item: item[1])
    return ranked[:limit]
"""

EDITS = {
    "rename": "Rename the variable `entries` to `records` everywhere in this module.",
    "type hints": "Add type hints to every function of this module.",
    "comprehension": "Rewrite the loop in `read_log` as a list comprehension; keep the other functions as they are.",
    "one-line fix": "`top_paths` returns the smallest paths instead of the largest. Fix that one-line bug.",
    "reorder args": "Reorder the arguments of `bytes_per_path` so that `entries` comes last, and update its caller.",
}


def edit_prompts(tok) -> dict[str, list[int]]:
    """Token ids of each edit request, through the model's chat template."""
    return {kind: chat_ids(tok, f"{task} Reply with the whole module.\n\n{EDIT_CODE}") for kind, task in EDITS.items()}


def chat_ids(tok, text: str) -> list[int]:
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tok.encode(rendered, add_special_tokens=False)


def prompts(tok) -> dict[str, list[int]]:
    """Token ids of each prompt kind, through the model's chat template where it is an instruction."""
    article = WIKITEXT.read_text()[3000:5200].strip()

    def chat(text: str) -> list[int]:
        return chat_ids(tok, text)

    return {
        "code edit": chat(f"Add type hints to every function of this module. Reply with the whole module.\n\n{CODE}"),
        "code completion": tok.encode(CODE + "\n\ndef filter_by_customer(orders, customer):\n"),
        "extractive": chat(f"{article}\n\nCopy the first three sentences of the text above exactly, word for word."),
        "open chat": chat("Write a short story about a lighthouse keeper who finds a message in a bottle."),
    }


@dataclass
class LatencyRow:
    model: str
    proposer: str
    prompt: str
    num_tokens: int
    seconds: float  # median wall time of one request
    plain_seconds: float
    speedup: float
    plain_ttft: float  # median time to the plain engine's first token: the target's prefill, which speculation
    # cannot shorten (a draft model's own prefill of the prompt comes after it, in the speculative engine's time)
    decode_speedup: float  # (plain - plain_ttft) / (spec - plain_ttft): the part speculation works on
    acceptance: float  # accepted / proposed drafts
    tokens_per_step: float  # generated tokens per verifying or plain step (1.0 without speculation)
    identical: bool  # greedy output equal to the plain engine's
    kept: int
    discarded: int
    other_shares: list[float] = field(default_factory=list)  # per repetition: CPU share other processes took
    rep_seconds: list[float] = field(default_factory=list)  # per repetition, kept or not
    best_speedup: float = 0.0  # fastest plain repetition / fastest speculative one: on a busy machine, the
    # repetition the other processes slowed least


def generate(engine: LLMEngine, ids: list[int], params: SamplingParams) -> tuple[list[int], float]:
    """The request's tokens, and the seconds to its first one."""
    t0 = time.perf_counter()
    request_id = engine.add_request(ids, params)
    tokens: list[int] = []
    ttft = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and ttft is None and out.outputs[0].token_ids:
                ttft = time.perf_counter() - t0
            if out.request_id == request_id and out.finished:
                tokens = out.outputs[0].token_ids
    return tokens, ttft


def quantized_copy(model: str, root: Path) -> Path:
    """The model quantized to int4 (group 64, head int8), as a cheaper draft."""
    out = root / f"{Path(model).name}-int4-draft"
    if not (out / "quantization_config.json").is_file():
        ckpt = read_checkpoint(model, progress=False)
        net = build_model(ckpt.config, ckpt.state_dict, torch.float32)
        compress(
            net, [RTNConfig(bits=4, group_size=64), RTNConfig(bits=8, group_size=None, ignore=())], None, progress=False
        )
        save_checkpoint(Checkpoint(net, ckpt.tokenizer), out)
    return out


def load_net(model: str):
    ckpt = read_checkpoint(model, progress=False)
    return build_model(ckpt.config, ckpt.state_dict, torch.bfloat16, quantized=ckpt.quantized), ckpt.tokenizer


def latency_rows(
    model: str, setups: dict[str, dict], reps: int, threshold: float, make_prompts=prompts, max_tokens: int = 128
) -> list[LatencyRow]:
    """Every setup (EngineConfig options) is an engine over the same target weights (drafts loaded once each);
    repetitions interleave the setups, so drift in the machine's speed hits all of them alike."""
    print(model, flush=True)
    net, tokenizer = load_net(model)
    specs = {options.get("speculative") for options in setups.values()}
    drafts = {spec: load_net(spec.split(":", 1)[1])[0] for spec in specs if spec and spec.startswith("draft:")}
    engines = {
        name: LLMEngine(
            net,
            tokenizer,
            EngineConfig.from_options(enable_prefix_caching=False, kv_cache_memory_bytes=512 << 20, **options),
            torch.device("cpu"),
            torch.bfloat16,
            drafts.get(options.get("speculative")),
        )
        for name, options in setups.items()
    }
    prompt_ids = make_prompts(tokenizer)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    longest = max(prompt_ids.values(), key=len)
    for engine in engines.values():  # warm-up: kernels, and memory touched once
        generate(engine, longest, SamplingParams(max_tokens=16))
    times = {(n, p): [] for n in engines for p in prompt_ids}
    ttfts = {(n, p): [] for n in engines for p in prompt_ids}
    discarded = {(n, p): 0 for n in engines for p in prompt_ids}
    shares = {(n, p): [] for n in engines for p in prompt_ids}
    measured = {(n, p): [] for n in engines for p in prompt_ids}  # every repetition, kept or not
    tokens, stats = {}, {}
    for rep in range(reps):
        for name, engine in engines.items():
            for prompt, ids in prompt_ids.items():
                before = engine.stats().spec_decode
                with CpuMonitor() as monitor:
                    t0 = time.perf_counter()
                    tokens[name, prompt], ttft = generate(engine, ids, params)
                    seconds = time.perf_counter() - t0
                shares[name, prompt].append(round(monitor.sample.other_share, 3))
                measured[name, prompt].append((seconds, ttft))
                if monitor.sample.is_contaminated(threshold):
                    discarded[name, prompt] += 1
                else:
                    times[name, prompt].append(seconds)
                    ttfts[name, prompt].append(ttft)
                if before is not None:
                    after = engine.stats().spec_decode
                    old = stats.get((name, prompt), (0, 0))
                    stats[name, prompt] = (
                        old[0] + after.num_draft_tokens - before.num_draft_tokens,
                        old[1] + after.num_accepted_tokens - before.num_accepted_tokens,
                    )
        print(f"  repetition {rep + 1} of {reps} done", flush=True)
    num_kept = {key: len(kept) for key, kept in times.items()}
    for key, kept in times.items():
        if not kept:  # every repetition was contaminated: use them all (the row shows 0 kept)
            times[key] = [seconds for seconds, _ in measured[key]]
            ttfts[key] = [ttft for _, ttft in measured[key]]
    rows = []
    for name in engines:
        for prompt in prompt_ids:
            drafted, accepted = stats.get((name, prompt), (0, 0))
            num = len(tokens[name, prompt])
            seconds, plain = median(times[name, prompt]), median(times["plain", prompt])
            prefill = median(ttfts["plain", prompt])
            rows.append(
                LatencyRow(
                    model,
                    name,
                    prompt,
                    num,
                    seconds,
                    plain,
                    plain / seconds,
                    prefill,
                    (plain - prefill) / (seconds - prefill),
                    accepted / drafted if drafted else 0.0,
                    num * reps / max(num * reps - accepted, 1),  # a forward yields accepted + 1
                    tokens[name, prompt] == tokens["plain", prompt],
                    num_kept[name, prompt],
                    discarded[name, prompt],
                    shares[name, prompt],
                    [round(seconds, 3) for seconds, _ in measured[name, prompt]],
                    min(t for t, _ in measured["plain", prompt]) / min(t for t, _ in measured[name, prompt]),
                )
            )
            print(f"  {rows[-1]}", flush=True)
    del engines, drafts, net
    gc.collect()
    return rows


def prefault(gib: int) -> None:
    """Write `gib` GiB once and free it. In this VM the first write to a page costs about 1.8 s per GiB; without
    this, whichever engine runs first pays it for its KV pool and activations and looks up to 15% slower."""
    if gib > 0:
        block = torch.ones(gib << 28, dtype=torch.float32)
        del block


@dataclass
class ExitRow:
    num_layers: int  # the draft: the target's first num_layers layers, its final norm and head
    agreement: dict[str, float]  # per prompt kind: share of positions where the draft's argmax is the target's
    step_ms: float  # median batch-1 decode step (forward and head) with a 300-token context
    relative_cost: float  # step_ms over the whole model's


def scratch_cache(net, num_tokens: int) -> tuple[PagedKVCache, list[int]]:
    """A fresh bfloat16 KV cache of blocks of 16 for `num_tokens` positions of `net` (outside any engine), and its
    block ids."""
    cfg = net.config
    num_blocks = -(-num_tokens // 16)
    cache = PagedKVCache.allocate(
        cfg.num_hidden_layers, num_blocks, cfg.num_key_value_heads, 16, cfg.head_dim, torch.bfloat16, "cpu"
    )
    return cache, list(range(num_blocks))


def decode_step_ms(net, rows: int = 1, reps: int = 15) -> float:
    """Median time of one step of `rows` decode entries of one request (positions 300 on, every layer, the head
    on every row: a verification of rows - 1 drafts), on its own cache."""
    cache, blocks = scratch_cache(net, 384)
    ctx = build_forward_context([1] * rows, list(range(301, 301 + rows)), [blocks] * rows, cache)
    ids, positions = torch.full((rows,), 100), torch.arange(300, 300 + rows)
    times = []
    with torch.inference_mode(), forward_context(ctx):
        for _ in range(reps + 3):
            t0 = time.perf_counter()
            net.compute_logits(net(ids, positions))
            times.append(time.perf_counter() - t0)
    return 1000 * median(times[3:])


@dataclass
class CostRow:
    model: str
    rows: int  # decode entries in the step: 1 = plain decode, 1 + k = verifying k drafts
    step_ms: float
    relative: float  # over the target's 1-row step


def cost_rows(root: Path, row_counts: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8), rounds: int = 7) -> list[CostRow]:
    """The terms of speculation's step cost on the Qwen pair: a target step verifying k drafts (1 + k rows) and a
    draft step, each over a plain target decode step. The models' steps interleave (`rounds` times, median)."""
    nets = {
        QWEN: load_net(QWEN)[0],
        QWEN_SMALL: load_net(QWEN_SMALL)[0],
        f"{QWEN_SMALL} int4": load_net(str(quantized_copy(QWEN_SMALL, root)))[0],
    }
    cases = [(QWEN, rows) for rows in row_counts] + [(name, 1) for name in nets if name != QWEN]
    times: dict[tuple[str, int], list[float]] = {case: [] for case in cases}
    for _ in range(rounds):
        for name, rows in cases:
            times[name, rows].append(decode_step_ms(nets[name], rows))
    base = median(times[QWEN, 1])
    rows = [CostRow(name, n, median(times[name, n]), median(times[name, n]) / base) for name, n in cases]
    for row in rows:
        print(row, flush=True)
    return rows


def exit_argmax(net, ids: list[int]) -> torch.Tensor:
    """Teacher-forced argmax at every position of `ids` [T], in one prefill on a scratch cache."""
    cache, blocks = scratch_cache(net, len(ids))
    ctx = build_forward_context([len(ids)], [len(ids)], [blocks], cache)
    with torch.inference_mode(), forward_context(ctx):
        return net.compute_logits(net(torch.tensor(ids), torch.arange(len(ids)))).argmax(dim=-1)


def exit_rows(
    layer_counts: tuple[int, ...] = (8, 16, 20, 24, 26, 28), rounds: int = 5, model: str = SMOL
) -> list[ExitRow]:
    """Why self-speculation does not pay on SmolLM2: how often an early exit agrees with the whole model (the
    ceiling of its greedy acceptance) against what its step costs. Untrained on SMOL; through the trained exits
    of a `leanlm train --exits` checkpoint where `model` has them (first_layers picks them)."""
    net, tokenizer = load_net(model)
    prompt_ids = prompts(tokenizer)
    full = {kind: exit_argmax(net, ids) for kind, ids in prompt_ids.items()}
    drafts = {num_layers: net.first_layers(num_layers) for num_layers in layer_counts}
    times: dict[int | None, list[float]] = {n: [] for n in [None, *layer_counts]}
    for _ in range(rounds):  # interleaved, so drift in the machine's speed hits every depth alike
        for n in times:
            times[n].append(decode_step_ms(net if n is None else drafts[n]))
    full_ms = median(times[None])
    rows = []
    for num_layers, draft in drafts.items():
        agreement = {
            kind: (exit_argmax(draft, ids) == full[kind]).float().mean().item() for kind, ids in prompt_ids.items()
        }
        step_ms = median(times[num_layers])
        rows.append(ExitRow(num_layers, agreement, step_ms, step_ms / full_ms))
        print(rows[-1], flush=True)
    return rows


@dataclass
class BatchRow:
    setting: str
    tokens_per_s: float
    acceptance: float
    kept: int
    discarded: int


def batch_rows(reps: int, threshold: float) -> list[BatchRow]:
    """16 code-completion requests at once on SmolLM2 (each a different cut of the module, so they differ); the
    three engines share the weights and their repetitions interleave."""
    net, tokenizer = load_net(SMOL)
    lines = CODE.splitlines()
    batch = [tokenizer.encode("\n".join(lines[: 12 + i]) + "\n") for i in range(16)]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    settings = {
        "plain": {},
        "ngram, switch at 8 requests (default)": dict(speculative="ngram"),
        "ngram forced on (switch at 64)": dict(speculative="ngram", speculative_max_batch_size=64),
    }
    engines = {
        name: LLMEngine(
            net,
            tokenizer,
            EngineConfig.from_options(enable_prefix_caching=False, kv_cache_memory_bytes=512 << 20, **options),
            torch.device("cpu"),
            torch.bfloat16,
        )
        for name, options in settings.items()
    }

    def run(engine: LLMEngine) -> float:
        t0 = time.perf_counter()
        for ids in batch:
            engine.add_request(ids, params)
        num_tokens = 0
        while engine.has_unfinished_requests():
            num_tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
        return num_tokens / (time.perf_counter() - t0)

    for engine in engines.values():
        run(engine)  # warm-up
    values = {name: [] for name in engines}
    discarded = dict.fromkeys(engines, 0)
    before = {name: e.stats().spec_decode for name, e in engines.items() if e.stats().spec_decode is not None}
    for _ in range(reps):
        for name, engine in engines.items():
            with CpuMonitor() as monitor:
                value = run(engine)
            if monitor.sample.is_contaminated(threshold):
                discarded[name] += 1
            else:
                values[name].append(value)
    rows = []
    for name, engine in engines.items():
        acceptance = 0.0
        if name in before:
            after = engine.stats().spec_decode
            drafts = after.num_draft_tokens - before[name].num_draft_tokens
            acceptance = (after.num_accepted_tokens - before[name].num_accepted_tokens) / drafts if drafts else 0.0
        rows.append(BatchRow(name, median(values[name]), acceptance, len(values[name]), discarded[name]))
        print(rows[-1], flush=True)
    return rows


@dataclass
class MemoryRow:
    setting: str
    peak_blocks: int  # most KV blocks held between steps
    peak_mib: float


def peak_blocks(llm: LLM, requests: list[tuple[list[int], SamplingParams]]) -> int:
    engine = llm.llm_engine
    for ids, params in requests:
        engine.add_request(ids, params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.num_kv_blocks - engine.stats().num_free_kv_blocks)
    return peak


def memory_rows() -> list[MemoryRow]:
    tok = read_checkpoint(SMOL, progress=False).tokenizer
    ids = tok.encode(WIKITEXT.read_text()[10_000:40_000], add_special_tokens=False)[:512]
    sample = dict(max_tokens=64, temperature=0.8, ignore_eos=True)
    rows = []
    for setting, caching, requests in (
        (
            "4 independent requests, prefix cache off",
            False,
            [(ids, SamplingParams(seed=i, **sample)) for i in range(4)],
        ),
        ("4 independent requests, prefix cache on", True, [(ids, SamplingParams(seed=i, **sample)) for i in range(4)]),
        ("n = 4 (one request, forked KV), prefix cache off", False, [(ids, SamplingParams(n=4, seed=0, **sample))]),
    ):
        llm = LLM(SMOL, dtype="bfloat16", progress=False, enable_prefix_caching=caching)
        blocks = peak_blocks(llm, requests)
        per_block = llm.llm_engine.kv_cache_bytes / llm.llm_engine.num_kv_blocks
        rows.append(MemoryRow(setting, blocks, blocks * per_block / 2**20))
        print(rows[-1], flush=True)
        del llm
    return rows


def format_report(
    latency: list[LatencyRow],
    batches: list[BatchRow],
    exits: list[ExitRow],
    costs: list[CostRow],
    memory: list[MemoryRow],
    args,
) -> str:
    lines = [
        f"Measured by `python benchmarks/speculative.py --reps {args.reps}` on {describe_machine()}, "
        f"bfloat16. Batch 1, greedy, up to 128 tokens, prefix caching off; "
        "speedup = plain wall time / speculative wall time for the whole request (median of the kept "
        "repetitions); decode speedup leaves out the target's prefill, which both engines spend alike (plain "
        "TTFT: the plain engine's time to its first token) and which speculation cannot shorten, but keeps "
        "everything the speculative engine adds (a draft model's prefill of the prompt included); "
        "acceptance = accepted / proposed drafts; tokens/step = generated tokens per target forward.",
        "",
        "| model | proposer | prompt | tokens | plain s | plain TTFT s | spec s | speedup | decode speedup | "
        "acceptance | tokens/step | identical | kept / discarded |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in latency:
        if r.proposer == "plain":
            continue
        lines.append(
            f"| {r.model} | {r.proposer} | {r.prompt} | {r.num_tokens} | {r.plain_seconds:.2f} | "
            f"{r.plain_ttft:.2f} | {r.seconds:.2f} | {r.speedup:.2f}x | {r.decode_speedup:.2f}x | "
            f"{r.acceptance:.2f} | {r.tokens_per_step:.2f} | {'yes' if r.identical else 'NO'} | "
            f"{r.kept} / {r.discarded} |"
        )
    if costs:
        lines += [
            "",
            "**Step costs of the Qwen pair** (batch 1, 300 tokens of context, head on every row; median "
            "of interleaved rounds): a verification of k drafts is a target step of 1 + k rows; a draft step "
            "is one row of the draft:",
            "",
            "| model | rows | step ms | vs a plain target step |",
            "|---|---:|---:|---:|",
        ]
        for c in costs:
            lines.append(f"| {c.model} | {c.rows} | {c.step_ms:.1f} | {c.relative:.2f} |")
    if exits:
        kinds = list(exits[0].agreement)
        lines += [
            "",
            f"**Early exits of {SMOL}** (self-speculation's draft: the first K of 30 layers, the final norm "
            "and head; agreement = share of a prompt's positions where its argmax equals the whole model's, "
            "teacher-forced; a decode step at batch 1, 300 tokens of context):",
            "",
            "| K | " + " | ".join(f"agreement, {k}" for k in kinds) + " | step ms | vs whole model |",
            "|---:|" + "---:|" * len(kinds) + "---:|---:|",
        ]
        for e in exits:
            lines.append(
                f"| {e.num_layers} | "
                + " | ".join(f"{e.agreement[k]:.2f}" for k in kinds)
                + f" | {e.step_ms:.2f} | {e.relative_cost:.2f} |"
            )
    lines += [
        "",
        f"**Batches** ({SMOL}, 16 code-completion requests at once, 64 tokens each, greedy):",
        "",
        "| setting | tokens/s | acceptance | kept / discarded |",
        "|---|---:|---:|---|",
    ]
    for b in batches:
        lines.append(f"| {b.setting} | {b.tokens_per_s:.1f} | {b.acceptance:.2f} | {b.kept} / {b.discarded} |")
    lines += [
        "",
        f"**KV memory of parallel sampling** ({SMOL}, a 512-token WikiText prompt, 64 sampled tokens "
        "each, peak blocks of 16 tokens held between steps):",
        "",
        "| setting | peak KV blocks | peak KV MiB | vs independent, no cache |",
        "|---|---:|---:|---:|",
    ]
    base = memory[0].peak_blocks if memory else 1
    for m in memory:
        lines.append(f"| {m.setting} | {m.peak_blocks} | {m.peak_mib:.1f} | {100 * (m.peak_blocks / base - 1):+.0f}% |")
    return "\n".join(lines)


def format_trained_exits(results: dict) -> str:
    """Self-speculation on SmolLM2 through its untrained exits (final norm) and through trained ones."""
    lines = [
        "| exits | setup | prompt | speedup | decode speedup | acceptance | tokens/step | identical |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for label, part in results.items():
        for r in map(lambda d: LatencyRow(**d), part["latency"]):
            if r.proposer != "plain":
                lines.append(
                    f"| {label} | {r.proposer} | {r.prompt} | {r.speedup:.2f}x | {r.decode_speedup:.2f}x | "
                    f"{r.acceptance:.2f} | {r.tokens_per_step:.2f} | {'yes' if r.identical else 'NO'} |"
                )
    lines += ["", "| exits | K | " + " | ".join(f"agreement, {k}" for k in PROMPT_KINDS) + " | step ms |"]
    lines.append("|---|---:|" + "---:|" * len(PROMPT_KINDS) + "---:|")
    for label, part in results.items():
        for e in map(lambda d: ExitRow(**d), part["agreement"]):
            cells = " | ".join(f"{e.agreement[k]:.2f}" for k in PROMPT_KINDS)
            lines.append(f"| {label} | {e.num_layers} | {cells} | {e.step_ms:.2f} |")
    return "\n".join(lines)


PROMPT_KINDS = ("code edit", "code completion", "extractive", "open chat")


def edit_setups(ks: tuple[int, ...]) -> dict[str, dict]:
    """Plain decoding, then prompt lookup (ngram) and the edit-following proposer (suffix) at each k."""
    setups = {"plain": {}}
    for k in ks:
        for method in ("ngram", "suffix"):
            setups[f"{method}, k <= {k}"] = dict(speculative=method, num_speculative_tokens=k)
    return setups


def edit_command(args) -> str:
    return (
        f"python benchmarks/speculative.py --workload edits --reps {args.reps} --edit-models {args.edit_models} "
        f"--edit-ks {args.edit_ks} --edit-tokens {args.edit_tokens} --threshold {args.threshold}"
    )


def format_edits(rows: list[LatencyRow], runs: dict[str, dict]) -> str:
    """`runs`: per model, the command and machine of the run that measured its rows."""
    lines = [
        "Measured: "
        + "; ".join(f"{model} by `{run['command']}` on {run['machine']}" for model, run in runs.items())
        + ". "
        "bfloat16, batch 1, greedy, prefix caching off, each model's setups in one run over shared weights with "
        "interleaved repetitions. Speedup = plain wall time / speculative wall time for the whole request "
        "(median of the kept repetitions; where none was kept, of all); tokens/step = generated tokens per "
        "target forward; other CPU = the share of both cores that other processes took in each repetition "
        "(a repetition is kept when it is at most the run's --threshold).",
        "",
        "| model | proposer | edit | tokens | plain s | spec s | speedup | best-rep speedup | acceptance | "
        "tokens/step | identical | kept / discarded | other CPU per rep |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for r in rows:
        if r.proposer == "plain":
            continue
        lines.append(
            f"| {r.model} | {r.proposer} | {r.prompt} | {r.num_tokens} | {r.plain_seconds:.2f} | {r.seconds:.2f} | "
            f"{r.speedup:.2f}x | {f'{r.best_speedup:.2f}x' if r.rep_seconds else 'n/a'} | {r.acceptance:.2f} | "
            f"{r.tokens_per_step:.2f} | "
            f"{'yes' if r.identical else 'NO'} | {r.kept} / {r.discarded} | "
            f"{', '.join(f'{x:.2f}' for x in r.other_shares)} |"
        )
    lines += [
        "",
        "Per model and proposer, over the five edits: workload speedup = the plain requests' summed time over the "
        "speculative ones' (medians; best-rep: each request's fastest repetition); geometric mean of the "
        "per-request speedups; mean acceptance and tokens/step:",
        "",
        "| model | proposer | workload speedup | best-rep workload speedup | geomean speedup | acceptance | "
        "tokens/step | all identical |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for (model, proposer), group in _groups(rows).items():
        workload = sum(r.plain_seconds for r in group) / sum(r.seconds for r in group)
        best = "n/a"  # runs before per-repetition times were recorded
        if all(r.rep_seconds for r in rows if r.model == model):
            plain = {r.prompt: min(r.rep_seconds) for r in rows if r.model == model and r.proposer == "plain"}
            best = f"{sum(plain[r.prompt] for r in group) / sum(min(r.rep_seconds) for r in group):.2f}x"
        geomean = math.prod(r.speedup for r in group) ** (1 / len(group))
        lines.append(
            f"| {model} | {proposer} | {workload:.2f}x | {best} | {geomean:.2f}x | "
            f"{statistics.mean(r.acceptance for r in group):.2f} | "
            f"{statistics.mean(r.tokens_per_step for r in group):.2f} | "
            f"{'yes' if all(r.identical for r in group) else 'NO'} |"
        )
    return "\n".join(lines)


def _groups(rows: list[LatencyRow]) -> dict[tuple[str, str], list[LatencyRow]]:
    groups: dict[tuple[str, str], list[LatencyRow]] = {}
    for r in rows:
        if r.proposer != "plain":
            groups.setdefault((r.model, r.proposer), []).append(r)
    return groups


def run_edits(args) -> None:
    """`--workload edits`: the five held-out code edits, plain vs ngram vs suffix, per model."""
    root = Path(args.results_dir)
    root.mkdir(parents=True, exist_ok=True)
    saved = root / "edits.json"
    results = json.loads(saved.read_text()) if saved.is_file() else {}
    prefault(args.prefault_gib)
    setups = edit_setups(tuple(int(k) for k in args.edit_ks.split(",")))
    for model in args.edit_models.split(","):
        rows = latency_rows(model, setups, args.reps, args.threshold, edit_prompts, args.edit_tokens)
        results[model] = [asdict(r) for r in rows]
        results.setdefault("runs", {})[model] = {"command": edit_command(args), "machine": describe_machine()}
        saved.write_text(json.dumps(results, indent=2))
    runs = results.pop("runs")
    rows = [LatencyRow(**r) for model in runs for r in results[model]]
    report = format_edits(rows, runs)
    print(report)
    if args.doc:
        replace_section(Path(args.doc), "edit-speculation-results", report)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threshold", type=float, default=0.10, help="other processes' CPU share that discards a rep")
    ap.add_argument("--parts", default="smollm2,qwen,costs,exits,batch,memory")
    ap.add_argument(
        "--prefault-gib",
        type=int,
        default=8,
        help="touch this much memory first: a VM's first touch of a page is slow, later reuse is not",
    )
    ap.add_argument("--exits-model", default=None, help="trained-exits part: a `leanlm train --exits` checkpoint")
    ap.add_argument("--results-dir", default="bench-results/speculative")
    ap.add_argument("--doc", default=None)
    ap.add_argument(
        "--workload", choices=("default", "edits"), default="default", help="edits: the held-out code edits only"
    )
    ap.add_argument("--edit-models", default=SMOL, help="edits: comma-separated models")
    ap.add_argument("--edit-ks", default="4,8", help="edits: comma-separated num_speculative_tokens")
    ap.add_argument("--edit-tokens", type=int, default=256, help="edits: most tokens per request")
    args = ap.parse_args()
    if args.workload == "edits":
        run_edits(args)
        return
    parts = set(args.parts.split(","))
    root = Path(args.results_dir)
    root.mkdir(parents=True, exist_ok=True)
    saved = root / "results.json"
    results = json.loads(saved.read_text()) if saved.is_file() else {}
    prefault(args.prefault_gib)
    if "smollm2" in parts:
        setups = {
            name: dict(speculative=spec)
            for name, spec in (
                ("plain", None),
                ("ngram", "ngram"),
                ("lookahead", "lookahead"),
                ("self:24", "self:24"),
                ("self:16", "self:16"),
                ("draft: its int4 copy", f"draft:{quantized_copy(SMOL, root)}"),
            )
        }
        results["smollm2"] = [asdict(r) for r in latency_rows(SMOL, setups, args.reps, args.threshold)]
    if "qwen" in parts:
        int4 = f"draft:{quantized_copy(QWEN_SMALL, root)}"
        setups = {
            name: dict(speculative=spec, num_speculative_tokens=k)
            for name, spec, k in (
                ("plain", None, 4),
                ("ngram", "ngram", 4),
                ("lookahead", "lookahead", 4),
                (f"draft: {QWEN_SMALL}", f"draft:{QWEN_SMALL}", 4),
                (f"draft: {QWEN_SMALL} int4", int4, 4),
                (f"draft: {QWEN_SMALL} int4, k <= 6", int4, 6),
            )
        }
        results["qwen"] = [asdict(r) for r in latency_rows(QWEN, setups, args.reps, args.threshold)]
    if "costs" in parts:
        results["costs"] = [asdict(r) for r in cost_rows(root)]
    if "exits" in parts:
        results["exits"] = [asdict(r) for r in exit_rows()]
    if "trained-exits" in parts:  # self:K before and after `leanlm train --exits` (docs/training.md)
        if args.exits_model is None:
            raise SystemExit("--parts trained-exits needs --exits-model DIR (a `leanlm train --exits` output)")
        setups = {"plain": {}, "self:24": dict(speculative="self:24"), "self:16": dict(speculative="self:16")}
        results["trained_exits"] = {
            label: {
                "latency": [asdict(r) for r in latency_rows(model, setups, args.reps, args.threshold)],
                "agreement": [asdict(r) for r in exit_rows((8, 16, 24), model=model)],
            }
            for label, model in (("untrained", SMOL), ("trained", args.exits_model))
        }
        print(format_trained_exits(results["trained_exits"]))
    if "batch" in parts:
        results["batch"] = [asdict(r) for r in batch_rows(args.reps, args.threshold)]
    if "memory" in parts:
        results["memory"] = [asdict(r) for r in memory_rows()]
    saved.write_text(json.dumps(results, indent=2))
    report = format_report(
        [LatencyRow(**r) for r in results.get("smollm2", []) + results.get("qwen", [])],
        [BatchRow(**r) for r in results.get("batch", [])],
        [ExitRow(**r) for r in results.get("exits", [])],
        [CostRow(**r) for r in results.get("costs", [])],
        [MemoryRow(**r) for r in results.get("memory", [])],
        args,
    )
    print(report)
    if args.doc:
        replace_section(Path(args.doc), "speculative-results", report)


if __name__ == "__main__":
    main()
