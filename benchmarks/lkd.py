"""ZeroQuant's LKD after RTN against RTN and GPTQ alone, on the same calibration data, in one run (issue 18's target:
LKD after RTN closes more of the gap than GPTQ alone, or the report shows where and why it does not).

    python benchmarks/lkd.py --model qwen2.5-coder-0.5b-instruct --ppl-windows 4 --kl-windows 1

The same protocol as benchmarks/quantization.py (whose machinery this reuses): each configuration is quantized from
the float32 model, saved, loaded back through `LLM(dir)` and scored in bfloat16.
"""

from __future__ import annotations

from quantization import Study, main, quant_recipe  # benchmarks/

from leanlm.compress import LKDConfig

# name -> quant_recipe's options, plus `lkd`: LKDConfig fields for a step after the quantizer
CONFIGS: dict[str, dict] = {
    "W4A16 g64 RTN": dict(method="rtn", bits=4),
    "W4A16 g64 RTN + LKD": dict(method="rtn", bits=4, lkd=dict(steps=100, lr=1e-4)),
    "W4A16 g64 GPTQ": dict(method="gptq", bits=4),
    "W3A16 g64 RTN": dict(method="rtn", bits=3),
    "W3A16 g64 RTN + LKD": dict(method="rtn", bits=3, lkd=dict(steps=100, lr=1e-4)),
    "W3A16 g64 RTN + LKD lr 1e-3": dict(method="rtn", bits=3, lkd=dict(steps=100, lr=1e-3)),
    "W3A16 g64 GPTQ": dict(method="gptq", bits=3),
}


def recipe(opts: dict) -> list:
    opts = dict(opts)
    lkd = opts.pop("lkd", None)
    return quant_recipe(opts) + ([] if lkd is None else [LKDConfig(**lkd)])


LKD = Study(CONFIGS, recipe, "benchmarks/lkd.py", "bench-results/lkd", "Quantized", "quantize s")

if __name__ == "__main__":
    main(LKD, __doc__)
