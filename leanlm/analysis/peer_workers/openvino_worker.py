"""OpenVINO GenAI as a benchmark peer: `openvino_genai.LLMPipeline` with a SchedulerConfig, i.e. its continuous
batching pipeline on a paged KV cache, fed token ids (no tokenizer in the timed path). Runs inside the OpenVINO
virtual environment (benchmarks/setup_peers.sh); the protocol is in worker_io.

model_dir is an OpenVINO IR directory from `optimum-cli export openvino`. options: {"properties": {...}} are CPU
plugin properties passed to the pipeline as they are (e.g. {"KV_CACHE_PRECISION": "bf16"}); none by default, so
the plugin picks what it picks for its users (reported in the info event). {"prefix_caching": true} turns on
its prefix cache (off by default: repetitions resubmit the same prompts unless the request has distinct_reps).
"""

from __future__ import annotations

import sys

import numpy as np
import openvino as ov
import openvino_genai
from worker_io import Engine, serve

# DYNAMIC_QUANTIZATION_GROUP_SIZE: the plugin quantizes the activations of int8 / int4 weight-compressed layers
# to int8 on the fly, in groups of this many inputs (0: off).
REPORTED_PROPERTIES = ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "INFERENCE_NUM_THREADS")
REPORTED_PROPERTIES += ("DYNAMIC_QUANTIZATION_GROUP_SIZE",)


def describe(request: dict) -> dict:
    core = ov.Core()
    defaults = {name: str(core.get_property("CPU", name)) for name in REPORTED_PROPERTIES}
    return {
        "peer": "openvino",
        "versions": {"openvino": ov.__version__, "openvino_genai": openvino_genai.__version__},
        "cpu_plugin_defaults": defaults,
        "properties": request["options"].get("properties", {}),
        "prefix_caching": bool(request["options"].get("prefix_caching", False)),
    }


def scheduler_config(request: dict, max_num_seqs: int) -> openvino_genai.SchedulerConfig:
    """A paged cache and at most max_num_seqs running sequences. The cap holds only in the scheduler's vLLM-like
    mode: with dynamic_split_fuse (the default) OpenVINO bounds a step by max_num_batched_tokens alone and runs
    every submitted prompt at once (seen here: the same tok/s at every cap), so that mode is turned off."""
    config = openvino_genai.SchedulerConfig()
    config.dynamic_split_fuse = False
    config.max_num_seqs = max_num_seqs
    config.max_num_batched_tokens = request["max_num_batched_tokens"]
    config.cache_size = request["kv_cache_gib"]  # GB of paged KV cache, allocated up front
    config.enable_prefix_caching = bool(request["options"].get("prefix_caching", False))
    return config


def generation_config(output_len: int) -> openvino_genai.GenerationConfig:
    """Greedy, exactly output_len tokens: EOS ignored."""
    config = openvino_genai.GenerationConfig()
    config.do_sample = False
    config.max_new_tokens = output_len
    config.min_new_tokens = output_len
    config.ignore_eos = True
    return config


def tokenized(prompts: list[list[int]]) -> openvino_genai.TokenizedInputs:
    """Prompts of different lengths as one padded batch; the continuous-batching pipeline drops the padding by
    the attention mask and runs each prompt as its own sequence."""
    width = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), width), dtype=np.int64)
    mask = np.zeros((len(prompts), width), dtype=np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    return openvino_genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(mask))


def load(request: dict, max_num_seqs: int) -> Engine:
    properties = request["options"].get("properties", {})
    pipe = openvino_genai.LLMPipeline(
        request["model_dir"], "CPU", scheduler_config=scheduler_config(request, max_num_seqs), **properties
    )

    def generate(prompts: list[list[int]], output_len: int):
        result = pipe.generate(tokenized(prompts), generation_config(output_len))
        first_token_ms = result.perf_metrics.get_ttft().mean  # from the call to the first token of any prompt
        return [list(map(int, tokens)) for tokens in result.tokens], first_token_ms / 1000

    return Engine(generate=generate, close=lambda: None)


if __name__ == "__main__":
    sys.exit(serve(describe, load))
