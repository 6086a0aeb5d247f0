"""Pipeline parallelism (GPipe, Huang et al. 2019, at inference): the decoder layers split into consecutive stages,
one group of ranks each; a step's requests split into micro-batches that flow through the stages, so that stage s
computes micro-batch m while stage s+1 computes m-1. With S stages and M micro-batches a step takes M + S - 1 stage
times instead of M * S: the bubble, (S - 1) / (M + S - 1) of each rank's time, is what stays idle."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from leanlm.engine import ModelRunner, StepOutput, StepPlan
from leanlm.model.context import forward_context
from leanlm.model.linear.act_quant import activation_quant
from leanlm.model.llama import LlamaForCausalLM
from leanlm.parallel.world import DRIVER_RANK, RankContext


def stage_bounds(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """[start, stop) layers of each stage: as even as the count allows, earlier stages one more."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(
            f"pipeline_parallel_size={num_stages} needs at least one decoder layer per stage; "
            f"the model has {num_layers}"
        )
    bounds, start = [], 0
    for s in range(num_stages):
        count = num_layers // num_stages + (1 if s < num_layers % num_stages else 0)
        bounds.append((start, start + count))
        start += count
    return bounds


def cut_stage(model: LlamaForCausalLM, start: int, stop: int, is_first: bool, is_last: bool) -> LlamaForCausalLM:
    """Keep layers [start, stop) of `model` (in place), re-indexed from 0 into the stage's own KV cache; the embedding
    stays on the first stage, the final norm and the LM head on the last (a tied head keeps its weight there)."""
    layers = list(model.model.layers)[start:stop]
    for idx, layer in enumerate(layers):
        layer.self_attn.layer_idx = idx
    model.model.layers = nn.ModuleList(layers)
    if not is_first:
        model.model.embed_tokens = None
    if not is_last:
        model.model.norm, model.lm_head = None, None
    windows = model.config.layer_windows[start:stop]  # the stage's layers' own (Mistral, Gemma)
    moe = model.config.moe
    if moe is not None and moe.sparse_layers is not None:  # its layers with experts, counted from the stage's first
        moe = dataclasses.replace(moe, sparse_layers=tuple(i - start for i in moe.sparse_layers if start <= i < stop))
    model.config = dataclasses.replace(
        model.config, num_hidden_layers=stop - start, exit_layers=(), layer_windows=windows, moe=moe
    )
    model.disable_native_decode()  # its plan reads the layers this stage no longer holds
    return model


def stage_forward(
    runner: ModelRunner, rank: RankContext, plan: StepPlan, x: torch.Tensor | None
) -> torch.Tensor | StepOutput:
    """This stage's layers over one micro-batch: from the token ids (first stage) or the hidden states x [T, hidden]
    the stage before sent; returns the hidden states for the next stage, or (last stage) the logits [R, V] and the
    pooled rows."""
    model = runner.model
    runner.move_blocks(plan)
    ctx = runner.context_for(plan)
    with forward_context(ctx), activation_quant(runner.act_quant):
        if rank.is_first_stage:
            x = model.model.embed(plan.input_ids)  # [T, hidden]
        rope = model.rotary_emb(plan.positions, x.dtype)
        for layer in model.model.layers:
            x = layer(x, rope)
        if not rank.is_last_stage:
            return x
        # the whole stream normed, then indexed, as the one-process model does (a norm's row path depends on rows)
        hidden = model.model.norm(x)
        return StepOutput.of(model.compute_logits(hidden[plan.logit_rows]), hidden, plan)


def run_pipeline(
    runner: ModelRunner, rank: RankContext, plans: list[StepPlan], hidden_size: int, dtype: torch.dtype
) -> list[StepOutput]:
    """Every micro-batch through this rank's stage, sends overlapping the next micro-batch's compute. The driver
    returns each micro-batch's logits [R, V] and pooled rows (received from the last stage); other ranks return []."""
    sends, outputs = [], []
    device = rank.device
    for plan in plans:
        x = None
        if not rank.is_first_stage:
            x = torch.empty(plan.num_tokens, hidden_size, dtype=dtype, device=device)
            dist.recv(x, src=rank.peer(rank.stage - 1))
        y = stage_forward(runner, rank, plan, x)
        if not rank.is_last_stage:
            sends.append(dist.isend(y.contiguous(), dst=rank.peer(rank.stage + 1)))
        elif rank.rank == DRIVER_RANK:
            outputs.append(y)
        elif rank.tp.rank == 0:  # the last stage's first tensor rank answers the driver
            sends.append(dist.isend(y.logits.contiguous(), dst=DRIVER_RANK))
            if y.pooled is not None:
                sends.append(dist.isend(y.pooled.contiguous(), dst=DRIVER_RANK))
    if rank.rank == DRIVER_RANK and not rank.is_last_stage:
        vocab, last = runner.config.vocab_size, rank.layout.rank_at(rank.layout.pipeline_parallel_size - 1, 0)
        for plan in plans:
            logits = torch.empty(plan.logit_rows.shape[0], vocab, dtype=dtype, device=device)
            dist.recv(logits, src=last)
            pooled = None
            if plan.pool_segments:
                pooled = torch.empty(len(plan.pool_segments), hidden_size, dtype=torch.float32, device=device)
                dist.recv(pooled, src=last)
            outputs.append(StepOutput(logits, pooled))
    for handle in sends:
        handle.wait()
    return outputs
