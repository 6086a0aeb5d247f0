"""Outputs of the bundled model recorded before a refactor, and the rule that compares a run with them.

`python -m tests.golden_cases [CASE ...]` records tests/golden_outputs.json, every case or the named ones (run it
on a tree whose outputs are known good);
tests/test_golden_outputs.py replays every case. Greedy cases store each token's margin (top-1 minus top-2
logprob). On the machine and tree that recorded them (same CPU model, ISA flags, torch, and leanlm's sources)
every token must match; elsewhere a greedy comparison stops at the first near tie, since other kernels' rounding,
or a later commit's, may break a tie the other way. (The sources are in the key because a commit that changed
prompt attention's summation order, 95d8124, moved the bf16 cases' ties on the recording CPU while every other
CPU, comparing up to the ties, still passed. The thread count is not: 1 and 2 threads give the same tokens.)
Sampled and beam cases run in float32, whose differences across CPUs are far below their gaps.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

GOLDEN_PATH = Path(__file__).with_name("golden_outputs.json")

PROMPTS = (
    "The three primary colors are",
    "def fibonacci(n):",
    "Paris is the capital of France. Berlin is the capital of",
)
# Prompts sharing a long prefix: prefix caching hits, chunked prefill splits them.
SHARED = "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who"
SHARED_PROMPTS = (SHARED + " had", SHARED + " made", SHARED + " never")


@dataclass(frozen=True)
class Case:
    name: str
    dtype: str
    kind: str = "greedy"  # greedy | sample | beam
    prompts: tuple[str, ...] = PROMPTS
    max_tokens: int = 20
    engine_options: dict = field(default_factory=dict)
    # greedy: positions whose recorded margin is below this are near ties; the comparison stops there
    tie_margin: float = 1e-3
    # as LLM(dequantize_gguf=...): False runs the GGUF's Q4_1 linears on their codes; the other cases use the file
    # dequantized (recorded so). The case names ("bf16_gguf_codes") are the keys of golden_outputs.json: kept
    dequantize_gguf: bool = True


CASES = (
    Case("float32", "float32"),
    Case("bfloat16", "bfloat16", tie_margin=0.15),
    Case(
        "bf16_int8_kv_chunked_prefix",
        "bfloat16",
        prompts=SHARED_PROMPTS,
        tie_margin=0.3,
        engine_options=dict(kv_cache_dtype="int8", max_num_batched_tokens=16, enable_prefix_caching=True),
    ),
    Case("fp32_spec_self", "float32", engine_options=dict(speculative="self:12")),
    Case("fp32_spec_ngram", "float32", prompts=SHARED_PROMPTS, engine_options=dict(speculative="ngram")),
    Case("bf16_spec_lookahead", "bfloat16", tie_margin=0.15, engine_options=dict(speculative="lookahead")),
    Case("fp32_sample_n3", "float32", kind="sample"),
    Case("fp32_beam3", "float32", kind="beam", max_tokens=12),
    # Without the int4 kernels (another CPU) the codes run as bf16-rounded weights, not exact codes arithmetic:
    # logits move by a few bf16 steps (0.125 near 20), so ties are wider than for the dense bf16 cases.
    Case("bf16_gguf_codes", "bfloat16", tie_margin=0.5, dequantize_gguf=False),
    Case(
        "bf16_gguf_codes_batched", "bfloat16", prompts=PROMPTS + SHARED_PROMPTS, tie_margin=0.5, dequantize_gguf=False
    ),
)


def run_case(case: Case) -> list[dict]:
    """One record per prompt (per completion for sampling, per hypothesis for beams)."""
    from leanlm import LLM, BeamSearchParams, SamplingParams

    llm = LLM(
        dtype=case.dtype,
        progress=False,
        num_kv_blocks=256,
        dequantize_gguf=case.dequantize_gguf,
        act_quant="none",  # recorded on 16-bit activations (int8 ones became the default later, issue 38)
        **case.engine_options,
    )
    if case.kind == "beam":
        outputs = llm.beam_search(
            list(case.prompts), BeamSearchParams(beam_width=3, max_tokens=case.max_tokens), use_tqdm=False
        )
        return [{"token_ids": s.token_ids, "score": s.score} for out in outputs for s in out.sequences]
    if case.kind == "sample":
        params = SamplingParams(n=3, temperature=0.8, top_p=0.95, seed=1234, max_tokens=case.max_tokens)
        outputs = llm.generate(list(case.prompts), params, use_tqdm=False)
        return [{"token_ids": c.token_ids} for out in outputs for c in out.outputs]
    params = SamplingParams(temperature=0.0, max_tokens=case.max_tokens, logprobs=2, ignore_eos=True)
    records = []
    for out in llm.generate(list(case.prompts), params, use_tqdm=False):
        completion = out.outputs[0]
        margins = []
        for token, top in zip(completion.token_ids, completion.logprobs):
            others = sorted((lp for t, lp in top.items() if t != token), reverse=True)
            margins.append(top[token] - others[0] if others else float("inf"))
        records.append({"token_ids": completion.token_ids, "margins": margins})
    return records


def code_fingerprint(root: Path | None = None) -> str:
    """A digest of leanlm's Python and C sources (or those under `root`): any change to them may change the
    numerics."""
    import hashlib

    root = root or Path(__file__).resolve().parent.parent / "leanlm"
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".c", ".h") and p.is_file()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def machine_key() -> str:
    """What decides the numerics: the CPU model, the ISA flags the kernels dispatch on, torch, and the code."""
    import torch

    from leanlm.kernels import cpu_decode
    from leanlm.kernels.build import cpu_model_name

    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    isa = ",".join(sorted(f for f in fields.get("flags", "").split() if f.startswith(("avx512", "avx2", "amx", "fma"))))
    family = f"family {fields.get('cpu family')} model {fields.get('model')} stepping {fields.get('stepping')}"
    kernels = "native kernels" if cpu_decode.is_available() else "PyTorch only"
    return f"{cpu_model_name()} | {family} | {isa} | torch {torch.__version__} | {kernels} | code {code_fingerprint()}"


def agreeing_prefix(expected: dict, actual: list[int], tie_margin: float) -> tuple[int, int | None]:
    """(tokens compared, first position that differs where no near tie excuses it, or None)."""
    for i, (want, got) in enumerate(zip(expected["token_ids"], actual)):
        if expected["margins"][i] < tie_margin:
            return i, None  # a near tie: later tokens follow from whichever way it broke
        if want != got:
            return i, i
    return min(len(expected["token_ids"]), len(actual)), None


def recorded_on(golden: dict, name: str) -> str:
    """The machine key a case was recorded on: its own entry in "machines", else the file's "machine"."""
    return golden.get("machines", {}).get(name, golden["machine"])


def main(names: list[str]) -> None:
    """Record every case, or only the named ones (the others keep their records and machine keys)."""
    golden = json.loads(GOLDEN_PATH.read_text()) if names and GOLDEN_PATH.exists() else {"machine": machine_key()}
    for case in CASES:
        if not names or case.name in names:
            golden[case.name] = run_case(case)
            if golden["machine"] != machine_key():
                golden.setdefault("machines", {})[case.name] = machine_key()
    GOLDEN_PATH.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {GOLDEN_PATH}")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
