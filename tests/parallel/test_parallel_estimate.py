"""`leanlm estimate`'s parallel view against a run: the bytes rank 0 holds and the all-reduce bytes its tensor
group moved equal what leanlm.analysis.parallel_estimate predicts for the same model and layout."""

from __future__ import annotations

from leanlm import LLM, SamplingParams
from leanlm.analysis import estimate as est
from leanlm.analysis.model_shape import load_shape
from leanlm.analysis.parallel_estimate import all_reduce_bytes_per_token, device_weight_bytes

PROMPTS = [[5, 17, 99, 3, 250, 7, 8], [400, 12], list(range(30, 70))]


def _resident_bytes(model) -> int:
    """Bytes of the distinct tensors a rank's model holds (a tied head shares the embedding's), rotary tables aside."""
    seen, total = set(), 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name.startswith("rotary_emb") or t.untyped_storage().data_ptr() in seen:
            continue
        seen.add(t.untyped_storage().data_ptr())
        total += t.numel() * t.element_size()
    return total


def test_bytes_per_device_and_all_reduce_bytes_match_the_estimate(parallel_checkpoints):
    path = parallel_checkpoints["dense"]
    shape, _ = load_shape(path)
    max_tokens = 8
    with LLM(path, dtype="float32", progress=False, tensor_parallel_size=2) as llm:
        rank = llm.parallel.rank_model
        llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
        stats = rank.rank.tp.stats
        held = _resident_bytes(rank.model)
    forwarded = sum(len(p) for p in PROMPTS) + (max_tokens - 1) * len(PROMPTS)  # the last token is never fed back
    per_token = all_reduce_bytes_per_token(shape, shape.num_hidden_layers, first_stage=True, act_bytes=4)
    assert stats.all_reduce_bytes == forwarded * per_token
    assert stats.num_all_reduces % (2 * shape.num_hidden_layers + 1) == 0  # per forward: 2 a layer + the embedding
    assert held == device_weight_bytes(shape, est.weight_format("fp32"), 2, shape.num_hidden_layers, True, True)
