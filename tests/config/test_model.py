"""ModelConfig, RopeScaling and MoEConfig refuse numbers the math cannot take, however they are built (issue 47
item 3): the loaders' mapping checks each file key, and the dataclasses check what a caller passes directly."""

from __future__ import annotations

import dataclasses
import math

import pytest

from leanlm.config import ModelConfig, RopeScaling
from leanlm.config.moe import MoEConfig
from tests.conftest import tiny_config

BASE = tiny_config(100)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"rms_norm_eps": math.nan}, r"ModelConfig.rms_norm_eps must be a finite number in \(0.0, 1.0\], got nan"),
        ({"rms_norm_eps": 2.0}, "rms_norm_eps must be a finite number"),
        ({"rope_theta": math.inf}, "ModelConfig.rope_theta must be a finite number"),
        ({"num_hidden_layers": True}, r"ModelConfig.num_hidden_layers must be an integer, got True \(bool\)"),
        ({"num_attention_heads": 4.0}, "ModelConfig.num_attention_heads must be an integer, got 4.0"),
        ({"hidden_size": 2**31}, r"ModelConfig.hidden_size must be an integer in \[1, 2147483647\]"),
        ({"tie_word_embeddings": "false"}, "ModelConfig.tie_word_embeddings must be true or false"),
        ({"eos_token_ids": (-1,)}, r"ModelConfig.eos_token_ids must be an integer in \[0, "),
        ({"bos_token_id": "1"}, "ModelConfig.bos_token_id must be an integer"),
        ({"clip_qkv": math.nan}, "ModelConfig.clip_qkv must be a finite number"),
        ({"rope_scaling": "lol"}, "ModelConfig.rope_scaling must be a RopeScaling or None"),
        ({"moe": {"num_experts": 4}}, "ModelConfig.moe must be a MoEConfig or None"),
        ({"layer_windows": (True, None)}, "layer_windows needs one window"),
    ],
)
def test_model_config_refuses_numbers_the_math_cannot_take(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(BASE, **change)


@pytest.mark.parametrize(
    "args,message",
    [
        (("llama3", 8.0, 4.0, 4.0), r"high_freq_factor \(4.0\) must be above low_freq_factor \(4.0\)"),  # 0 division
        (("llama3", math.nan), "rope_scaling factor must be a finite number"),
        (("linear", 2.0, 1.0, 4.0, 0), "rope_scaling original_max_position_embeddings must be an integer in"),
        (("linear", "2"), "rope_scaling factor must be a number, got '2'"),
    ],
)
def test_rope_scaling_refuses_bad_numbers(args, message):
    with pytest.raises(ValueError, match=message):
        RopeScaling(*args)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"num_experts": 4.0}, "MoEConfig.num_experts must be an integer"),
        ({"router_aux_loss_coef": math.nan}, "MoEConfig.router_aux_loss_coef must be a finite number"),
        ({"shared_expert_gate": 1}, "MoEConfig.shared_expert_gate must be true or false"),
        ({"sparse_layers": ("0",)}, r"MoEConfig.sparse_layers \(layer indices\) must be an integer"),
    ],
)
def test_moe_config_refuses_bad_numbers(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(MoEConfig(4, 2, 32), **change)


def test_from_hf_dict_names_the_key():
    raw = BASE.to_hf_dict()
    assert ModelConfig.from_hf_dict(raw) == BASE
    assert ModelConfig.from_hf_dict({**raw, "num_hidden_layers": 2.0}).num_hidden_layers == 2  # JSON's 2e0
    for key, value, message in [
        ("rope_scaling", "lol", r"rope_scaling must be an object \(a dict of named values\), got 'lol'"),
        ("num_attention_heads", 0, r"num_attention_heads must be an integer in \[1, "),
        ("rms_norm_eps", math.nan, "rms_norm_eps must be a finite number"),
        ("num_attention_heads", None, "config.json has no num_attention_heads"),
        ("vocab_size", "49152", r"vocab_size must be an integer, got '49152' \(str\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_hf_dict({**raw, key: value})
    with pytest.raises(ValueError, match=r"hidden_size \(64\) is not a multiple of num_attention_heads \(3\)"):
        ModelConfig.from_hf_dict({**raw, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": None})


def test_value_checks():
    from leanlm.config.values import check_float, check_int, to_int

    assert to_int(1e6, "n") == 1_000_000 and isinstance(to_int(1e6, "n"), int)
    assert check_float(3, "x") == 3.0 and check_float(0.0, "x", 0.0, open_minimum=False) == 0.0
    for bad in (True, 1.5, math.nan, "3", None, [3]):
        with pytest.raises(ValueError, match="n must be an integer"):
            to_int(bad, "n")
    with pytest.raises(ValueError, match=r"n must be an integer in \[0, 5\], got 6"):
        check_int(6, "n", 0, 5)
