"""`leanlm bench latency | throughput`: our engine and its peers (HF transformers, llama.cpp, OpenVINO GenAI,
vLLM) on the same model, prompts and machine, in one run.

Every in-process peer is a Runner with two measurements: batch-1 latency (time to first token and time per output
token for one prompt) and offline throughput (output tokens/s for a list of prompts). Peers in environments of
their own (OpenVINO, vLLM) are PeerRunners (peer_runner.py): throughput only, every batch size in one worker
process. Each timed
repetition records the CPU share other processes used (/proc/stat); contaminated repetitions are kept apart, never
averaged in.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from leanlm.analysis.host import CpuMonitor, CpuSample

PEERS = ("hf", "llama.cpp", "openvino", "openvino-int8", "openvino-int4", "vllm")


@dataclass(frozen=True)
class LatencySample:
    """One batch-1 generation."""

    ttft_s: float  # prompt in, first token out
    token_times_s: list[float]  # gap before each later token

    @property
    def tpot_s(self) -> float:
        return statistics.fmean(self.token_times_s) if self.token_times_s else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return 1.0 / self.tpot_s


class Runner(Protocol):
    name: str

    def latency(self, prompt: list[int], output_len: int) -> LatencySample: ...

    def throughput(self, prompts: list[list[int]], output_len: int) -> float: ...


class LeanLMRunner:
    """Our engine, stepped directly (no HTTP): the token budget, paged KV and continuous batching at work."""

    name = "leanlm"

    def __init__(self, llm) -> None:
        self.llm = llm

    def latency(self, prompt: list[int], output_len: int) -> LatencySample:
        from leanlm.sampling_params import SamplingParams

        engine = self.llm.llm_engine
        engine.add_request(prompt, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
        times = [time.perf_counter()]
        while engine.has_unfinished_requests():
            if any(o.outputs[0].token_ids for o in engine.step()):
                times.append(time.perf_counter())
        gaps = [b - a for a, b in zip(times[1:], times[2:])]
        return LatencySample(times[1] - times[0], gaps)

    def throughput(self, prompts: list[list[int]], output_len: int) -> float:
        from leanlm.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        self.llm.generate(prompts, params, use_tqdm=False)
        return len(prompts) * output_len / (time.perf_counter() - t0)


class HFRunner:
    """HF transformers' eager `generate` with its dynamic KV cache; batches are padded on the left and sorted by
    length, so padding is as small as it gets."""

    name = "hf"

    def __init__(self, model, pad_id: int, batch_size: int = 32) -> None:
        self.model = model
        self.pad_id = pad_id
        self.batch_size = batch_size

    def latency(self, prompt: list[int], output_len: int) -> LatencySample:
        from transformers import StoppingCriteria, StoppingCriteriaList

        times: list[float] = []

        class Clock(StoppingCriteria):  # called once per generated token
            def __call__(self, input_ids, scores, **kwargs):
                times.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        t0 = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(
                input_ids=torch.tensor([prompt]),
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=self.pad_id,
                stopping_criteria=StoppingCriteriaList([Clock()]),
            )
        return LatencySample(times[0] - t0, [b - a for a, b in zip(times, times[1:])])

    def throughput(self, prompts: list[list[int]], output_len: int) -> float:
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        t0 = time.perf_counter()
        for start in range(0, len(order), self.batch_size):
            batch = [prompts[i] for i in order[start : start + self.batch_size]]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            with torch.inference_mode():
                self.model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=output_len,
                    min_new_tokens=output_len,
                    do_sample=False,
                    pad_token_id=self.pad_id,
                )
        return len(prompts) * output_len / (time.perf_counter() - t0)


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python, in process, on the GGUF as published (its own quantized kernels).
    Its Python API runs one sequence at a time, so its throughput here is sequential; llama.cpp's batched
    path is its server, measured by `leanlm bench serve` / benchmarks/serving.py."""

    name = "llama.cpp"

    def __init__(self, gguf_path: Path, n_ctx: int, n_threads: int | None = None) -> None:
        from llama_cpp import Llama

        threads = n_threads or torch.get_num_threads()
        self.llama = Llama(str(gguf_path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)

    def _generate(self, prompt: list[int], output_len: int):
        """Exactly output_len greedy tokens (generate() never stops by itself, EOS included). reset() first:
        otherwise llama-cpp-python reuses the KV of a previous prompt's common prefix."""
        self.llama.reset()
        return zip(range(output_len), self.llama.generate(prompt, top_k=1, temp=0.0, reset=True))

    def latency(self, prompt: list[int], output_len: int) -> LatencySample:
        t0 = time.perf_counter()
        times = [time.perf_counter() for _ in self._generate(prompt, output_len)]
        return LatencySample(times[0] - t0, [b - a for a, b in zip(times, times[1:])])

    def throughput(self, prompts: list[list[int]], output_len: int) -> float:
        t0 = time.perf_counter()
        for prompt in prompts:
            for _ in self._generate(prompt, output_len):
                pass
        return len(prompts) * output_len / (time.perf_counter() - t0)


@dataclass
class Repetitions:
    """Values of one measurement, with the CPU share others took during each; contaminated ones apart."""

    values: list = field(default_factory=list)
    other_shares: list[float] = field(default_factory=list)
    discarded: list[float] = field(default_factory=list)  # other CPU share of each discarded repetition

    def add(self, value, cpu: CpuSample, threshold: float) -> None:
        if cpu.is_contaminated(threshold):
            self.discarded.append(cpu.other_share)
        else:
            self.values.append(value)
            self.other_shares.append(cpu.other_share)


def repeat(fn: Callable[[], object], reps: int, threshold: float = 0.10) -> Repetitions:
    out = Repetitions()
    for _ in range(reps):
        with CpuMonitor() as monitor:
            value = fn()
        out.add(value, monitor.sample, threshold)
    return out


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
