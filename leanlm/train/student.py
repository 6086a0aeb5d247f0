"""A shallower student made from its teacher: the teacher's embeddings, final norm and head, and a subset of its
decoder layers, renumbered (DistilBERT's initialisation: one layer out of two). The student is an ordinary model
with fewer layers, so it trains, saves and serves like any other."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from leanlm.formats.checkpoint import Checkpoint
from leanlm.model.llama import LlamaForCausalLM, build_model


def spread_layers(num_layers: int, depth: int) -> list[int]:
    """`depth` of `num_layers` layer indices, evenly spaced from layer 0 (30 -> 15: 0, 2, ..., 28)."""
    if not 1 <= depth <= num_layers:
        raise ValueError(f"a student of {depth} layers needs 1 <= depth <= the teacher's {num_layers} layers")
    return [i * num_layers // depth for i in range(depth)]


def keep_layers(model: LlamaForCausalLM, layers: Sequence[int]) -> LlamaForCausalLM:
    """A new model (copied weights, same dtype and device) of `model` with only the decoder layers `layers`,
    in that order; layer layers[i] becomes layer i."""
    count = model.config.num_hidden_layers
    if not layers or any(not 0 <= i < count for i in layers) or len(set(layers)) != len(layers):
        raise ValueError(f"layers to keep must be distinct indices in [0, {count}), got {list(layers)}")
    old = model.state_dict()
    packed = [k for k, v in old.items() if not v.is_floating_point()]
    if packed:  # quantized / sparse layers store integer codes under other names than a float linear's
        raise ValueError(
            f"{packed[0]} is not a float tensor: make the student from a float model "
            "(leanlm.train.model.load_trainable)"
        )
    prefix = "model.layers."
    state = {k: v.clone() for k, v in old.items() if not k.startswith(prefix)}
    for new, index in enumerate(layers):
        head = f"{prefix}{index}."
        state.update({f"{prefix}{new}.{k[len(head) :]}": v.clone() for k, v in old.items() if k.startswith(head)})
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    config = dataclasses.replace(model.config, num_hidden_layers=len(layers))
    weight = model.model.embed_tokens.weight
    return build_model(config, state, weight.dtype, weight.device)


def student_of(teacher: Checkpoint, layers: Sequence[int]) -> Checkpoint:
    """keep_layers on a checkpoint: the student's model, the teacher's tokenizer, and the teacher's recipe followed
    by this step (so the saved student says how it was made)."""
    student = keep_layers(teacher.model, layers)
    step = {"method": "keep_layers", "layers": list(layers)}
    return dataclasses.replace(teacher, model=student, recipe=(*teacher.recipe, step), source=None)
