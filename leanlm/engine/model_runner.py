"""ModelRunner: owns the paged KV tensors, turns a SchedulerOutput into one flat forward, samples.

Rows sample only when their scheduled chunk reaches the request's last token; prompt logprobs are scored
from the same forward (logits at position p against prompt token p+1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leanlm.config import EngineConfig, ModelConfig
from leanlm.engine.outputs import ModelRunnerOutput, SchedulerOutput
from leanlm.engine.request import Request
from leanlm.engine.sampler import Sampler, SamplingMetadata, gather_logprobs, logprobs_to_dicts
from leanlm.model.context import build_forward_context, forward_context
from leanlm.model.kv_quant import SCALE_DTYPE, is_quantized, kv_storage_dtype
from leanlm.model.llama import LlamaForCausalLM


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V for every layer of one block: 2 * L * block_size * Hkv * (D * element size + scale bytes), where an
    8-bit cache (int8/fp8) keeps one float32 scale per (token, KV head) and a float cache none."""
    element = torch.empty(0, dtype=dtype).element_size()
    scale = torch.empty(0, dtype=SCALE_DTYPE).element_size() if is_quantized(dtype) else 0
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * (config.head_dim * element + scale)


def num_kv_blocks_for(config: ModelConfig, engine_config: EngineConfig, dtype: torch.dtype) -> int:
    if engine_config.num_kv_blocks is not None:
        return engine_config.num_kv_blocks
    per_block = kv_cache_bytes_per_block(config, engine_config.block_size, dtype)
    num_blocks = engine_config.kv_cache_memory_bytes // per_block
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory_bytes={engine_config.kv_cache_memory_bytes} holds no KV block "
            f"(one block needs {per_block} bytes); raise it or set num_kv_blocks"
        )
    return num_blocks


@dataclass(frozen=True)
class _BatchLayout:
    """Where each scheduled request sits in the flat batch."""

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    query_lens: list[int]  # per request
    row_starts: list[int]  # per request: its first row in the batch
    seq_lens: list[int]  # per request: tokens with KV after this step
    sample_rows: list[int]  # requests whose chunk ends at their last token
    sample_token_idx: list[int]  # batch row of each sampling request's last token


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        engine_config: EngineConfig,
        device: torch.device,
        model_dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.config: ModelConfig = model.config
        self.block_size = engine_config.block_size
        self.device = device
        self.kv_cache_dtype = kv_storage_dtype(engine_config.kv_cache_dtype, model_dtype)
        self.num_blocks = num_kv_blocks_for(self.config, engine_config, self.kv_cache_dtype)
        shape = (
            self.config.num_hidden_layers, 2, self.num_blocks, self.config.num_key_value_heads,
            self.block_size, self.config.head_dim,
        )
        self.kv_cache = torch.zeros(shape, dtype=self.kv_cache_dtype, device=device)  # [L, 2, N, Hkv, bs, D]
        # 8-bit caches: one scale per (token, KV head) beside the values; float caches have none
        self.kv_scales: torch.Tensor | None = None  # [L, 2, N, Hkv, bs] float32
        layers = range(shape[0])
        scales = None
        if is_quantized(self.kv_cache_dtype):
            self.kv_scales = torch.ones(shape[:-1], dtype=SCALE_DTYPE, device=device)
            scales = [(self.kv_scales[i, 0], self.kv_scales[i, 1]) for i in layers]
        model.bind_kv_cache([(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in layers], scales)
        tensors = (self.kv_cache,) if self.kv_scales is None else (self.kv_cache, self.kv_scales)
        self.kv_cache_bytes = sum(t.numel() * t.element_size() for t in tensors)
        self.sampler = Sampler()

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        requests = scheduler_output.scheduled_requests
        self._copy_blocks(scheduler_output.blocks_to_copy)  # copy-on-write, before the forward writes
        if not requests:
            return ModelRunnerOutput([], [], [])
        layout = self._layout(scheduler_output)
        ctx = build_forward_context(
            layout.query_lens, layout.seq_lens, scheduler_output.block_ids, self.block_size,
            self.config.num_key_value_heads, self.device,
        )
        with forward_context(ctx):
            hidden = self.model(layout.input_ids, layout.positions)  # [T, hidden]

        sampled: list[list[int]] = [[] for _ in requests]
        logprobs: list[list[dict[int, float]] | None] = [None] * len(requests)
        if layout.sample_rows:
            sample_reqs = [requests[i] for i in layout.sample_rows]
            logits = self.model.compute_logits(hidden[layout.sample_token_idx]).float()  # [Bs, V]
            metadata = SamplingMetadata.from_requests(
                sample_reqs, self.config.vocab_size, self.device, self.config.eos_token_ids
            )
            out = self.sampler(logits, metadata)
            token_ids = out.sampled_token_ids.tolist()
            lp_dicts = None
            if out.logprobs is not None:
                ks = [r.sampling_params.logprobs or 0 for r in sample_reqs]
                lp_dicts = logprobs_to_dicts(out.logprobs, ks)
            for j, row in enumerate(layout.sample_rows):
                sampled[row] = [token_ids[j]]
                if lp_dicts is not None and sample_reqs[j].sampling_params.logprobs is not None:
                    logprobs[row] = [lp_dicts[j]]
        scored = [self._prompt_logprobs(r, n, hidden, start) for r, n, start in zip(
            requests, layout.query_lens, layout.row_starts)]
        prompt_logprobs = [entries for entries, _ in scored]
        prompt_logprobs_full = [full for _, full in scored]
        return ModelRunnerOutput(sampled, logprobs, prompt_logprobs, prompt_logprobs_full)

    def _copy_blocks(self, blocks_to_copy: list[tuple[int, int]]) -> None:
        """KV (and 8-bit scales) of block src into block dst, in every layer, for each (src, dst) pair."""
        if not blocks_to_copy:
            return
        src, dst = (torch.tensor(ids, dtype=torch.long, device=self.device) for ids in zip(*blocks_to_copy))
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]  # [L, 2, n, Hkv, bs, D]
        if self.kv_scales is not None:
            self.kv_scales[:, :, dst] = self.kv_scales[:, :, src]  # [L, 2, n, Hkv, bs]

    def _layout(self, so: SchedulerOutput) -> _BatchLayout:
        ids: list[int] = []
        positions: list[int] = []
        seq_lens, sample_rows, sample_idx, row_starts = [], [], [], []
        for i, (req, n) in enumerate(zip(so.scheduled_requests, so.num_scheduled_tokens)):
            row_starts.append(len(ids))
            start = req.num_computed_tokens
            ids.extend(req.all_token_ids[start : start + n])
            positions.extend(range(start, start + n))
            seq_lens.append(start + n)
            if start + n == req.num_tokens:
                sample_rows.append(i)
                sample_idx.append(len(ids) - 1)
        as_long = dict(dtype=torch.long, device=self.device)
        return _BatchLayout(
            input_ids=torch.tensor(ids, **as_long),
            positions=torch.tensor(positions, **as_long),
            query_lens=list(so.num_scheduled_tokens),
            row_starts=row_starts,
            seq_lens=seq_lens,
            sample_rows=sample_rows,
            sample_token_idx=sample_idx,
        )

    def _prompt_logprobs(
        self, req: Request, num_new: int, hidden: torch.Tensor, row_start: int
    ) -> tuple[list[dict[int, float] | None] | None, torch.Tensor | None]:
        """Entries for prompt indices not yet recorded (a preempted request recomputes its prompt), and with
        full_prompt_logprobs the whole log-softmax behind them ([n, V] float32 on CPU, one row per non-None
        entry). Entry j scores prompt token j from position j-1; entry 0 is None. (None, None) when nothing is due.
        """
        k = req.sampling_params.prompt_logprobs
        if k is None:
            return None, None
        full = None
        start = req.num_computed_tokens
        first_entry = len(req.prompt_logprobs)  # next prompt index to record
        last_entry = min(start + num_new, req.num_prompt_tokens - 1)  # positions < P-1 score a prompt token
        entries: list[dict[int, float] | None] = []
        if first_entry == 0 and start == 0:
            entries.append(None)
            first_entry = 1
        # entry j comes from position j-1, which must lie in this chunk [start, start + num_new)
        first_entry = max(first_entry, start + 1)
        if first_entry <= last_entry:
            positions = torch.arange(first_entry - 1, last_entry, device=self.device)
            rows = row_start + (positions - start)
            logits = self.model.compute_logits(hidden[rows]).float()  # [Np, V]
            targets = torch.tensor(req.prompt_token_ids[first_entry : last_entry + 1], device=self.device)
            all_logprobs = torch.log_softmax(logits, dim=-1)  # [Np, V]
            lp = gather_logprobs(all_logprobs, targets, k)
            entries.extend(logprobs_to_dicts(lp, [k] * len(targets)))
            if req.sampling_params.full_prompt_logprobs:
                full = all_logprobs.cpu()
        return entries or None, full

