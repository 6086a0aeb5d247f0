"""Every native kernel has a PyTorch fallback, and the engine on the fallback computes what it computes on the
kernels. The fallback is what a CPU without AVX512-BF16 (or without a C compiler) runs; forcing it with
LEANLM_DISABLE_KERNELS=1 tests it on any CPU. Where the kernels are unavailable here, the comparison is
fallback against fallback and still checks that the whole engine runs without them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from leanlm import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]
NUM_TOKENS = 12

# Run in a child: kernel availability is decided once per process.
_CHILD = textwrap.dedent("""
    import json, sys
    from leanlm import LLM, SamplingParams
    from leanlm.kernels import cpu_decode, cpu_gemv, cpu_qgemv, paged_attention
    available = [m.is_available() for m in (cpu_gemv, cpu_qgemv, paged_attention, cpu_decode)]
    llm = LLM(dtype="bfloat16", progress=False)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in json.loads(sys.argv[1])]
    params = SamplingParams(max_tokens=int(sys.argv[2]), temperature=0.0, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    scores = [s.tolist() for s in llm.score([p + o for p, o in zip(prompts, outs)], use_tqdm=False)]
    print(json.dumps({"available": available, "tokens": outs, "scores": scores}))
""")


def _run_without_kernels() -> dict:
    env = dict(os.environ, LEANLM_DISABLE_KERNELS="1")
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(PROMPTS), str(NUM_TOKENS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.real_model
def test_the_engine_on_the_fallback_matches_the_native_kernels():
    fallback = _run_without_kernels()
    assert fallback["available"] == [False] * 4  # every kernel off, the native decode loop included
    llm = LLM(dtype="bfloat16", progress=False)  # this process: native kernels wherever this CPU has them
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    sequences = [p + o for p, o in zip(prompts, fallback["tokens"])]
    native = llm.score(sequences, use_tqdm=False)
    for prompt, ref, got in zip(prompts, (torch.tensor(s) for s in fallback["scores"]), native):
        kl = (ref.exp() * (ref - got)).sum(-1)  # KL(fallback || native), teacher-forced on the fallback's text
        assert kl.mean() < 0.01 and kl.max() < 0.05, (kl.mean(), kl.max())  # bf16 rounding, not a wrong kernel
        top2 = ref[len(prompt) - 1 :].topk(2).values
        clear = top2[:, 0] - top2[:, 1] > 0.5
        assert torch.equal(got[len(prompt) - 1 :].argmax(-1)[clear], ref[len(prompt) - 1 :].argmax(-1)[clear])
    # Free-running greedy decode (the native decode loop where available) agrees up to the first near tie.
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    for prompt, theirs, out, ref in zip(
        prompts,
        fallback["tokens"],
        llm.generate(prompts, params, use_tqdm=False),
        (torch.tensor(s) for s in fallback["scores"]),
    ):
        top2 = ref[len(prompt) - 1 :].topk(2).values
        first_tie = next((i for i, m in enumerate((top2[:, 0] - top2[:, 1]).tolist()) if m < 0.5), NUM_TOKENS)
        assert out.outputs[0].token_ids[:first_tie] == theirs[:first_tie]
