"""LoRA adapters on SmolLM2, in one run: (a) a batch of 32 requests over 8 random rank-16 adapters (on q, k, v, o,
gate, up, down) against the same batch on the base model alone, with each path of the batched product (a product per
run of rows, one masked product over the stacked slots, and the engine's choice); (b) a mixed batch of adapters and
base rows in float32 against each adapter merged into the weights; (c) QLoRA: a rank-16 adapter trained on the int4
RTN model (g64, head int8) on the first two thirds of WikiText-2 raw test, its perplexity on the last third (never
trained on) against the int4 and the float model.

Every timed repetition records the CPU share other processes used (/proc/stat); repetitions above --max-other-cpu
are discarded (counted in the table), the best clean one is reported.

    python benchmarks/lora.py --out docs/lora.md
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from quantized_decode import quantized_dir  # noqa: E402  benchmarks/: the int4 g64 RTN recipe (head int8)

from leanlm import LLM, SamplingParams  # noqa: E402
from leanlm.analysis.eval import make_windows, read_text  # noqa: E402
from leanlm.analysis.host import CpuMonitor, describe_machine  # noqa: E402
from leanlm.engine import LLMEngine  # noqa: E402
from leanlm.formats.loader import load_checkpoint  # noqa: E402
from leanlm.formats.peft import read_adapter, write_adapter  # noqa: E402
from leanlm.lora_request import LoRARequest  # noqa: E402
from leanlm.model import lora as lora_module  # noqa: E402
from leanlm.model.llama import build_model  # noqa: E402
from leanlm.model.lora import lora_target_shapes  # noqa: E402

WIKITEXT = Path(__file__).parent.parent / "leanlm" / "data" / "wikitext-2-raw" / "wiki.test.raw"


def random_adapters(config, root: Path, count: int, rank: int) -> dict[str, str]:
    """`count` random rank-`rank` adapters on every target linear: A as PEFT initializes it, B ~ N(0, 0.02), so each
    adapter moves the logits visibly (greedy outputs differ from the base's)."""
    gen = torch.Generator().manual_seed(0)
    paths = {}
    for k in range(count):
        weights = {
            name: (
                (torch.rand(rank, i, generator=gen) * 2 - 1) / math.sqrt(i),
                torch.randn(o, rank, generator=gen) * 0.02,
            )
            for name, (o, i) in lora_target_shapes(config).items()
        }
        paths[f"lora{k}"] = str(write_adapter(root / f"lora{k}", weights, rank, 2.0 * rank, "smollm2-135m-instruct"))
    return paths


def prompts_of(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    ids = tokenizer.encode(read_text(WIKITEXT)[:200_000], add_special_tokens=False)
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - 64, (count,), generator=gen).tolist()
    lens = torch.randint(16, 33, (count,), generator=gen).tolist()
    return [ids[s : s + n] for s, n in zip(starts, lens)]


def timed_batch(llm: LLM, prompts, loras, output_len: int, reps: int, max_other: float) -> tuple[float, str, list]:
    """Best output tokens/s of the batch over clean repetitions (if none is clean: the least disturbed one), the
    other processes' CPU share of each repetition, and the last outputs."""
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=2), use_tqdm=False, lora_request=loras[:4])  # warm-up
    samples, outputs = [], None
    for _ in range(reps):
        with CpuMonitor() as cpu:
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
            seconds = time.perf_counter() - start
        samples.append((cpu.sample.other_share, len(prompts) * output_len / seconds))
    clean = [rate for share, rate in samples if share <= max_other]
    best = max(clean) if clean else min(samples)[1]
    shares = ", ".join(f"{share:.0%}" for share, _ in samples) + ("" if clean else " (none clean: least disturbed)")
    return best, shares, outputs


def throughput(args, paths: dict[str, str]) -> list[str]:
    """(a): the 32-request batch on the base alone, and over the 8 adapters, per product path."""
    llm = LLM(args.model, enable_lora=True, max_loras=8, max_lora_rank=16, progress=False)
    plain = LLM(args.model, progress=False)
    prompts = prompts_of(llm.get_tokenizer(), args.batch)
    names = list(paths)
    loras = [LoRARequest(names[i % len(names)], paths[names[i % len(names)]]) for i in range(args.batch)]
    rows = []
    runs = [("base, engine without LoRA", plain, [None] * args.batch, None)]
    runs.append(("base, engine with LoRA on", llm, [None] * args.batch, None))
    runs.append(("base, the per-layer PyTorch path (native decode loop off)", llm, [None] * args.batch, "pytorch"))
    runs += [("8 adapters, engine's choice", llm, loras, None)]
    runs += [("8 adapters, a product per run of rows", llm, loras, 10**9)]
    runs += [("8 adapters, one masked product over the slots", llm, loras, 0)]
    base_rate = None
    outputs = {}
    for label, engine, batch_loras, max_runs in runs:
        saved = lora_module.MAX_SEGMENT_RUNS
        if isinstance(max_runs, int):
            lora_module.MAX_SEGMENT_RUNS = max_runs
        engine.llm_engine.model.allow_native_decode = max_runs != "pytorch"
        try:
            rate, discarded, outs = timed_batch(
                engine, prompts, batch_loras, args.output_len, args.reps, args.max_other_cpu
            )
        finally:
            lora_module.MAX_SEGMENT_RUNS = saved
            engine.llm_engine.model.allow_native_decode = True
        outputs[label] = [o.outputs[0].token_ids for o in outs]
        base_rate = base_rate or rate
        rows.append(f"| {label} | {rate:.1f} | {rate / base_rate:.2f}x | {discarded} |")  # discarded: the shares
        print(rows[-1], flush=True)
    lora_outs = [outputs[label] for label, *_ in runs[3:]]
    same = all(o == lora_outs[0] for o in lora_outs)
    differ = sum(a != b for a, b in zip(lora_outs[0], outputs[runs[0][0]]))
    rows.append("")
    slot_mib = llm.llm_engine.lora_manager.slots.nbytes / 2**20
    rows.append(f"The three adapter paths give the same greedy tokens: {same}. Requests whose tokens differ from the "
                f"base model's: {differ} of {args.batch}. Slots: {slot_mib:.1f} MiB ({llm.dtype}).")  # fmt: skip
    return rows


def exactness(args, paths: dict[str, str]) -> list[str]:
    """(b): float32, a batch of 3 adapters and base rows against each adapter merged into the float32 weights."""
    ckpt = load_checkpoint(args.model, "float32", progress=False)
    state = {k: v.clone() for k, v in ckpt.model.state_dict().items()}
    config, tokenizer = ckpt.config, ckpt.tokenizer
    names = list(paths)[:3]
    prompts = prompts_of(tokenizer, 6, seed=1)
    batch = [names[0], None, names[1], names[2], names[0], None]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=0, full_prompt_logprobs=True)

    def run(model, loras, **options):
        engine = LLMEngine(model, tokenizer, _engine_config(**options), torch.device("cpu"), torch.float32)
        ids = [engine.add_request(p, params, lora_request=lr) for p, lr in zip(prompts, loras)]
        final = {}
        while engine.has_unfinished_requests():
            final |= {o.request_id: o for o in engine.step() if o.finished}
        return [final[i] for i in ids]

    mixed = run(ckpt.model, [None if n is None else LoRARequest(n, paths[n]) for n in batch], enable_lora=True)
    worst, same_tokens = 0.0, True
    for name, got, prompt in zip(batch, mixed, prompts):
        merged = dict(state)
        if name is not None:
            adapter = read_adapter(paths[name])
            for module, (a, b) in adapter.weights.items():
                merged[f"{module}.weight"] = state[f"{module}.weight"] + adapter.scaling(module) * (b @ a)
        if config.tie_word_embeddings:
            merged.pop("lm_head.weight", None)
        want = _alone(config, merged, tokenizer, prompt, params)
        worst = max(worst, float((got.prompt_logprobs_full - want.prompt_logprobs_full).abs().max()))
        same_tokens &= got.outputs[0].token_ids == want.outputs[0].token_ids
    return [
        f"6 requests in one batch (adapters {batch}), float32: the largest difference of any prompt log-probability "
        f"from the same prompt alone on its adapter merged into the weights is **{worst:.2e}** (target 1e-4); greedy "
        f"tokens (8 each) identical: {same_tokens}."
    ]


def _engine_config(**options):
    from leanlm.config import EngineConfig

    return EngineConfig.from_options(act_quant="none", num_kv_blocks=256, **options)


def _alone(config, state, tokenizer, prompt, params):
    engine = LLMEngine(build_model(config, state, torch.float32), tokenizer, _engine_config(), torch.device("cpu"),
                       torch.float32)  # fmt: skip
    engine.add_request(prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        final |= {o.request_id: o for o in engine.step() if o.finished}
    return next(iter(final.values()))


def wikitext_split(tokenizer) -> tuple[list[int], list[int]]:
    """WikiText-2 raw test tokenized: the first two thirds (training) and the last third (evaluation)."""
    ids = tokenizer.encode(read_text(WIKITEXT), add_special_tokens=False)
    cut = 2 * len(ids) // 3
    return ids[:cut], ids[cut:]


def perplexity(llm: LLM, windows, lora: LoRARequest | None) -> float:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([list(w.token_ids) for w in windows], params, use_tqdm=False, lora_request=lora)
    nll, count = 0.0, 0
    for window, out in zip(windows, outputs):
        for j in range(window.num_context, len(window.token_ids)):
            nll -= out.prompt_logprobs[j][window.token_ids[j]]
            count += 1
    return math.exp(nll / count)


def qlora(args, root: Path) -> list[str]:
    """(c): train on the int4 model, then perplexity on the held-out third for float, int4, int4 + adapter."""
    from leanlm.train import TrainJob, run
    from leanlm.train.lora import LoRATrainConfig
    from leanlm.train.trainer import TrainConfig

    int4 = quantized_dir(args.model, "int4", root)
    float_llm = LLM(args.model, dtype="float32", dequantize_gguf=True, progress=False)
    train_ids, eval_ids = wikitext_split(float_llm.get_tokenizer())
    windows = make_windows(eval_ids, args.eval_seq_len, max_windows=args.eval_windows)
    text = root / "wikitext-train.txt"
    text.write_text(float_llm.get_tokenizer().decode(train_ids), encoding="utf-8")
    ppl_float = perplexity(float_llm, windows, None)
    del float_llm
    out = root / "qlora"
    # float32: this AVX2 CPU has no bf16 arithmetic (autocast's bf16 products would be emulated, several times slower)
    train = TrainConfig(tokens=args.train_tokens, seq_len=args.train_seq_len, batch_size=4, grad_accum=1, lr=args.lr,
                        dtype="float32", warmup_steps=5, eval_every=0, save_every=20,
                        max_seconds=args.train_seconds)  # fmt: skip
    job = TrainJob(out, model=str(int4), train=train, lora=LoRATrainConfig(r=16), data=str(text), overwrite=True)
    report = run(job, log=print)
    print(report.summary, flush=True)
    result = report.result
    int4_llm = LLM(str(int4), dtype="float32", enable_lora=True, progress=False)
    ppl_int4 = perplexity(int4_llm, windows, None)
    ppl_lora = perplexity(int4_llm, windows, LoRARequest("qlora", str(out)))
    closed = (ppl_int4 - ppl_lora) / (ppl_int4 - ppl_float) if ppl_int4 != ppl_float else float("nan")
    scored = sum(w.num_scored for w in windows)
    return [
        f"Trained {result.steps} steps, {result.tokens:,} tokens of the first two thirds of WikiText-2 raw test in "
        f"{result.seconds:.0f} s ({result.tokens_per_second:.0f} tokens/s; seq len {args.train_seq_len}, batch 4, "
        f"lr {args.lr}, warmup 5, cosine to a tenth over the {args.train_tokens:,}-token budget, rank 16 alpha 32 on "
        "q, k, v, o, gate, up, down; the int4 base frozen). Perplexity on the last third "
        f"({len(windows)} windows of {args.eval_seq_len}, {scored:,} scored tokens, float32):",
        "",
        "| model | perplexity |",
        "|---|---|",
        f"| float (the GGUF dequantized) | {ppl_float:.3f} |",
        f"| int4 g64 RTN (head int8) | {ppl_int4:.3f} |",
        f"| int4 + QLoRA adapter | {ppl_lora:.3f} |",
        "",
        f"The adapter closes **{closed:.1%}** of the int4 model's perplexity gap to float.",
    ]


def control(args, root: Path) -> list[str]:
    """(d): the same adapter training on a float model (a dense HF directory of the same weights): how much of (c)'s
    gain is the text itself (WikiText's own style), not the int4 loss recovered."""
    from leanlm.train import TrainJob, run
    from leanlm.train.lora import LoRATrainConfig
    from leanlm.train.trainer import TrainConfig

    float_llm = LLM(args.control_model, dtype="float32", enable_lora=True, progress=False)
    train_ids, eval_ids = wikitext_split(float_llm.get_tokenizer())
    windows = make_windows(eval_ids, args.eval_seq_len, max_windows=args.eval_windows)
    text = root / "wikitext-train.txt"
    text.write_text(float_llm.get_tokenizer().decode(train_ids), encoding="utf-8")
    out = root / "float-lora"
    train = TrainConfig(tokens=args.train_tokens, seq_len=args.train_seq_len, batch_size=4, grad_accum=1, lr=args.lr,
                        dtype="float32", warmup_steps=5, eval_every=0, save_every=20,
                        max_seconds=args.train_seconds)  # fmt: skip
    job = TrainJob(out, model=args.control_model, train=train, lora=LoRATrainConfig(r=16), data=str(text),
                   overwrite=True)  # fmt: skip
    result = run(job, log=print).result
    before = perplexity(float_llm, windows, None)
    after = perplexity(float_llm, windows, LoRARequest("float-lora", str(out)))
    return [
        f"The same run on the float model ({args.control_model}, bf16 weights loaded in float32): {result.steps} "
        f"steps, {result.tokens:,} tokens in {result.seconds:.0f} s. Perplexity on the same held-out third: "
        f"{before:.3f} -> **{after:.3f}** with its adapter.",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-other-cpu", type=float, default=0.25)
    ap.add_argument("--train-tokens", type=int, default=200_000)
    ap.add_argument("--train-seconds", type=float, default=420.0)
    ap.add_argument("--train-seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--eval-seq-len", type=int, default=512)
    ap.add_argument("--eval-windows", type=int, default=24)
    ap.add_argument("--control-model", default="/work/peers/smollm2-135m-instruct-dense", help="(d)'s float model")
    ap.add_argument(
        "--parts",
        default="a,b,c",
        help="parts to run: a (throughput), b (exactness), c (QLoRA), d (the same training on float)",
    )
    ap.add_argument("--work-dir", default=None, help="where adapters and the int4 model go (default: a temp dir)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    root = Path(args.work_dir or tempfile.mkdtemp(prefix="lora-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    config = load_checkpoint(args.model, "float32", progress=False).config
    paths = random_adapters(config, root, 8, 16)
    command = "python benchmarks/lora.py " + " ".join(sys.argv[1:])
    lines = ["# LoRA adapters: many in one batch, and QLoRA", "", f"Machine: {describe_machine()}.", "",
             f"Command: `{command}`", ""]  # fmt: skip
    if "a" in parts:
        lines += [f"## (a) {args.batch} requests over 8 rank-16 adapters against the base alone", "",
                  f"{args.model} as LLM(model) runs it (the GGUF's codes; the compute dtype auto picks on this CPU); "
                  f"{args.batch} prompts of 16-32 tokens from WikiText-2, {args.output_len} greedy tokens each, "
                  "adapter i % 8 for request i, "
                  f"max_loras=8, max_lora_rank=16; best of {args.reps} clean repetitions.", "",
                  "| batch | output tok/s | vs base | other processes' CPU share per repetition |",
                  "|---|---|---|---|"]  # fmt: skip
        lines += throughput(args, paths)
        lines.append("")
    if "b" in parts:
        lines += ["## (b) Outputs against the adapter merged into the weights", ""] + exactness(args, paths) + [""]
    if "c" in parts:
        lines += ["## (c) QLoRA on the int4 model", ""] + qlora(args, root) + [""]
    if "d" in parts:
        lines += ["## (d) Control: the same adapter training on the float model", ""] + control(args, root) + [""]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
