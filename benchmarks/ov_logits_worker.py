"""Run by the OpenVINO peer's own python (peers/openvino-venv): score token windows with one OpenVINO IR, once with
the CPU plugin's dynamic activation quantization off (DYNAMIC_QUANTIZATION_GROUP_SIZE 0) and once per group size
asked for, and print one JSON object: per setting the mean KL(off || setting) and both perplexities.

    openvino-venv/bin/python benchmarks/ov_logits_worker.py REQUEST.json

REQUEST.json: {"ir": DIR, "windows": [[token ids], ...], "group_sizes": [32]}. Each window's first token is context
only (LeanLM's eval windows, non-overlapping). Self-contained: LeanLM is not installed in that environment.
"""

from __future__ import annotations

import json
import math
import sys

import torch
from optimum.intel import OVModelForCausalLM


def logprobs(ir: str, group: int, windows: list[list[int]]) -> list[torch.Tensor]:
    config = {"DYNAMIC_QUANTIZATION_GROUP_SIZE": str(group), "PERFORMANCE_HINT": "LATENCY"}
    model = OVModelForCausalLM.from_pretrained(ir, ov_config=config)  # stateful IR: each call starts a new sequence
    out = []
    for ids in windows:
        x = torch.tensor([ids])
        logits = model(input_ids=x, attention_mask=torch.ones_like(x)).logits[0, :-1]  # [T - 1, V]: row t scores t + 1
        out.append(logits.double().log_softmax(-1))
    return out


def nll(lps: list[torch.Tensor], windows: list[list[int]]) -> float:
    total = sum(-float(lp.gather(1, torch.tensor(w[1:])[:, None]).sum()) for lp, w in zip(lps, windows))
    return total / sum(len(w) - 1 for w in windows)


def main() -> None:
    request = json.loads(open(sys.argv[1]).read())
    windows = request["windows"]
    base = logprobs(request["ir"], 0, windows)
    result = {"ir": request["ir"], "ppl_off": math.exp(nll(base, windows)), "settings": {}}
    for group in request["group_sizes"]:
        lps = logprobs(request["ir"], group, windows)
        kl = torch.cat([(p.exp() * (p - q)).sum(-1) for p, q in zip(base, lps)])
        top1 = float(torch.cat([(p.argmax(-1) == q.argmax(-1)).double() for p, q in zip(base, lps)]).mean())
        result["settings"][str(group)] = {"kl": float(kl.mean()), "top1": top1, "ppl": math.exp(nll(lps, windows))}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
