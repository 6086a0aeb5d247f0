"""`leanlm train`: the recipe behind each flag set, bad input refused before loading, and a run from a
pruned checkpoint to a checkpoint the engine loads, resumable."""

import json

import pytest
import torch

from leanlm.cli import main
from leanlm.compress import MagnitudeConfig, compress
from leanlm.formats import save_checkpoint
from leanlm.formats.checkpoint import Checkpoint
from leanlm.model.llama import build_model
from leanlm.train import build_sparsity
from leanlm.train.act_sparse import TEALTrainConfig
from leanlm.train.sparse import GMPConfig, SRSTEConfig, TopKASTConfig
from tests.conftest import tiny_config, tiny_state_dict

TEXT = " ".join(f"The clockmaker made clock number {i} for the village." for i in range(400))


def test_recipes_behind_the_flags():
    assert build_sparsity("finetune") is None
    assert build_sparsity("sr-ste", pattern="2:4", decay=1e-3) == SRSTEConfig(pattern="2:4", decay=1e-3)
    assert build_sparsity("gmp", sparsity=0.7) == GMPConfig(sparsity=0.7)
    assert build_sparsity("teal", sparsity=0.4) == TEALTrainConfig(sparsity=0.4)
    assert build_sparsity("top-kast", sparsity=0.8, backward_sparsity=0.6) == TopKASTConfig(
        sparsity=0.8, backward_sparsity=0.6
    )


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--recipe", "finetune", "--pattern", "2:4"], "need a sparsity recipe"),
        (["--recipe", "sr-ste", "--sparsity", "0.5"], "pass pattern"),
        (["--recipe", "gmp", "--rounds", "3"], "--rounds does not apply"),
        (["--recipe", "top-kast", "--pattern", "2:4"], "use SR-STE"),
        (["--recipe", "teal", "--pattern", "2:4"], "not an N:M pattern"),
        (["--recipe", "gmp", "--data", "/no/such/file"], "does not exist"),
        (["--tokens", "10"], "less than one optimizer step"),
    ],
)
def test_bad_input_is_a_clear_error(argv, message, capsys, tmp_path):
    assert main(["train", *argv, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.fixture
def pruned_dir(tmp_path, tokenizer):
    cfg = tiny_config(tokenizer.vocab_size)
    model = build_model(cfg, tiny_state_dict(cfg), torch.float32)
    report = compress(model, MagnitudeConfig(pattern="2:4"), progress=False)
    return save_checkpoint(Checkpoint(model, tokenizer).with_recipe(report.recipe), tmp_path / "pruned")


def test_train_a_pruned_checkpoint_into_one_the_engine_loads(pruned_dir, tmp_path, capsys):
    from leanlm.llm import load_model
    from leanlm.model.linear.sparse24 import Sparse24Linear

    data, out = tmp_path / "text.txt", tmp_path / "trained"
    data.write_text(TEXT)
    argv = ["train", "--model", str(pruned_dir), "--recipe", "sr-ste", "--pattern", "2:4", "--data", str(data)]
    argv += ["--seq-len", "32", "--tokens", str(32 * 8 * 3), "--save-every", "1", "--out", str(out)]
    assert main([*argv, "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "3 steps, 768 tokens" in printed and "sparsity of the trained linears: 50.0%" in printed
    assert not (out / "train_state.pt").exists()  # a finished run leaves no state behind
    model = load_model(str(out), progress=False)
    down = model.model.layers[1].mlp.down_proj
    assert isinstance(down, Sparse24Linear)
    recipe = json.loads((out / "quantization_config.json").read_text())["recipe"]
    assert [step["method"] for step in recipe] == ["magnitude", "train"]
    assert recipe[1]["sparsity"]["method"] == "sr-ste" and recipe[1]["tokens"] == 768


@pytest.fixture
def dense_and_text(tmp_path, tokenizer):
    """(config, a saved tiny dense checkpoint, a training text file); the config has 4 query and 2 K/V heads."""
    cfg = tiny_config(tokenizer.vocab_size)
    dense = save_checkpoint(
        Checkpoint(build_model(cfg, tiny_state_dict(cfg), torch.float32), tokenizer), tmp_path / "dense"
    )
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    return cfg, dense, data


def test_activation_sparsity_training_saves_layers_that_skip_small_inputs(dense_and_text, tmp_path, capsys):
    from leanlm.llm import load_model
    from leanlm.model.linear.act_sparse import ActSparseLinear

    cfg, dense, data = dense_and_text
    out = tmp_path / "teal"
    argv = ["train", "--model", str(dense), "--recipe", "teal", "--sparsity", "0.4", "--data", str(data)]
    argv += ["--seq-len", "32", "--tokens", str(32 * 8 * 2), "--out", str(out), "--device", "cpu"]
    assert main(argv) == 0
    assert "input sparsity of the trained linears: 40.0%" in capsys.readouterr().out
    recipe = json.loads((out / "quantization_config.json").read_text())["recipe"]
    assert [step["method"] for step in recipe] == ["train", "act-sparsity"]
    assert recipe[0]["sparsity"]["method"] == "teal" and recipe[1]["sparsity"] == 0.4
    model = load_model(str(out), progress=False)
    layers = [m for m in model.modules() if isinstance(m, ActSparseLinear)]
    assert len(layers) == 7 * cfg.num_hidden_layers and all(m.threshold_value > 0 for m in layers)
    trained = model.model.layers[0].mlp.down_proj.weight_t.t().float()
    untrained = tiny_state_dict(cfg)["model.layers.0.mlp.down_proj.weight"].float()
    assert not torch.allclose(trained, untrained, atol=1e-4)  # the weights trained, then were kept dense


def test_a_quantized_checkpoint_cannot_be_trained(tmp_path, tokenizer, capsys):
    from leanlm.compress import RTNConfig

    cfg = tiny_config(tokenizer.vocab_size)
    model = build_model(cfg, tiny_state_dict(cfg), torch.float32)
    compress(model, RTNConfig(bits=8), progress=False)
    path = save_checkpoint(Checkpoint(model, tokenizer), tmp_path / "int8")
    assert main(["train", "--model", str(path), "--out", str(tmp_path / "out"), "--device", "cpu"]) == 2
    assert "no float weight to train" in capsys.readouterr().err


def test_convert_to_multi_query_attention_and_uptrain(dense_and_text, tmp_path, capsys):
    from leanlm.llm import load_model

    cfg, dense, data = dense_and_text
    out = tmp_path / "mqa"
    argv = ["train", "--model", str(dense), "--kv-heads", "1", "--data", str(data), "--seq-len", "32"]
    argv += ["--tokens", str(32 * 8 * 2), "--out", str(out), "--device", "cpu"]
    assert main(argv) == 0
    assert "2 steps, 512 tokens" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 1
    recipe = json.loads((out / "quantization_config.json").read_text())["recipe"]
    assert [step["method"] for step in recipe] == ["gqa", "train"] and recipe[0]["init"] == "mean"
    model = load_model(str(out), progress=False)
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (cfg.head_dim, cfg.hidden_size)
    assert main([*argv[:4], "3", *argv[5:-4], "--out", str(tmp_path / "bad"), "--device", "cpu"]) == 2
    assert "divides 2" in capsys.readouterr().err


def test_upcycle_to_experts_and_train_with_the_balancing_loss(dense_and_text, tmp_path, capsys):
    from leanlm.llm import load_model
    from leanlm.model.moe import SparseMoeBlock

    cfg, dense, data = dense_and_text
    out = tmp_path / "moe"
    argv = ["train", "--model", str(dense), "--upcycle-experts", "4", "--data", str(data), "--seq-len", "32"]
    argv += ["--tokens", str(32 * 8 * 2), "--out", str(out), "--device", "cpu"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert (
        "sparse upcycling: 4 experts top-2 in every layer" in printed and "expert load over 2 sparse layers" in printed
    )
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == "mixtral" and saved["num_local_experts"] == 4
    recipe = json.loads((out / "quantization_config.json").read_text())["recipe"]
    assert [step["method"] for step in recipe] == ["upcycle", "train"] and recipe[0]["router_aux_loss_coef"] == 0.01
    model = load_model(str(out), progress=False)
    assert all(isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers)
    pr = ["train", "--model", str(dense), "--upcycle-experts", "2", "--pr-moe", "--upcycle-layers", "1"]
    pr += ["--data", str(data), "--seq-len", "32", "--tokens", "512", "--out", str(tmp_path / "pr"), "--device", "cpu"]
    assert main(pr) == 0
    assert "PR-MoE (zero init): 2 experts top-1 in layers 1" in capsys.readouterr().out
    assert json.loads((tmp_path / "pr" / "config.json").read_text())["leanlm_moe"]["sparse_layers"] == [1]
    assert main(["train", "--pr-moe", "--out", str(tmp_path / "bad")]) == 2
    assert "need --upcycle-experts" in capsys.readouterr().err


def test_quantization_aware_training_saves_trained_int4_layers(dense_and_text, tmp_path, capsys):
    from leanlm.compress import RTNConfig
    from leanlm.llm import load_model
    from leanlm.model.linear.int_group import IntGroupWeightOnlyLinear

    cfg, dense, data = dense_and_text
    out = tmp_path / "qat"
    argv = ["train", "--model", str(dense), "--qat-bits", "4", "--qat-group-size", "32", "--data", str(data)]
    argv += ["--seq-len", "32", "--tokens", str(32 * 8 * 3), "--lr", "1e-3", "--out", str(out), "--device", "cpu"]
    assert main(argv) == 0
    assert "3 steps, 768 tokens" in capsys.readouterr().out
    layers = json.loads((out / "quantization_config.json").read_text())["layers"]
    assert len(layers) == 14 and {m["format"] for m in layers.values()} == {"int_group_weight_only"}
    trained = load_model(str(out), progress=False).model.layers[0].mlp.up_proj
    rtn = build_model(cfg, tiny_state_dict(cfg), torch.float32)
    compress(rtn, RTNConfig(bits=4, group_size=32), progress=False)
    assert isinstance(trained, IntGroupWeightOnlyLinear) and trained.bits == 4
    assert not torch.equal(trained.dequantized_weight(), rtn.model.layers[0].mlp.up_proj.dequantized_weight())
    assert main([*argv[:-4], "--recipe", "gmp", "--out", str(tmp_path / "bad")]) == 2
    assert "does not combine" in capsys.readouterr().err


def test_quantization_aware_training_of_a_gptq_checkpoint(tmp_path, tokenizer, capsys):
    from leanlm.compress import GPTQConfig
    from leanlm.llm import load_model

    cfg = tiny_config(tokenizer.vocab_size)
    ids = torch.randint(0, cfg.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))

    def gptq(name, **kw):
        model = build_model(cfg, tiny_state_dict(cfg), torch.float32)
        compress(model, GPTQConfig(bits=4, group_size=32, **kw), ids, progress=False)
        return model, save_checkpoint(Checkpoint(model, tokenizer), tmp_path / name)

    start, static = gptq("static", act_order=True, static_groups=True)
    data, out = tmp_path / "text.txt", tmp_path / "qat"
    data.write_text(TEXT)
    argv = ["train", "--model", str(static), "--qat", "--data", str(data), "--seq-len", "32", "--lr", "1e-3"]
    argv += ["--tokens", str(32 * 8 * 2), "--out", str(out), "--device", "cpu"]
    assert main(argv) == 0
    assert "quantization-aware training of the checkpoint's quantized layers, 2 steps" in capsys.readouterr().out
    trained = load_model(str(out), progress=False).model.layers[0].mlp.up_proj
    before = start.model.layers[0].mlp.up_proj
    assert trained.perm is None and trained.bits == 4
    assert not torch.equal(trained.dequantized_weight(), before.dequantized_weight())
    _, permuted = gptq("act-order", act_order=True)
    assert main([*argv[:2], str(permuted), *argv[3:-4], "--out", str(tmp_path / "bad"), "--device", "cpu"]) == 2
    assert "static groups" in capsys.readouterr().err
    assert main([*argv, "--qat-bits", "4"]) == 2
    assert "pick one" in capsys.readouterr().err


def test_fake_quant_layers_swap_in_and_back(tmp_path):
    from leanlm.compress import RTNConfig
    from leanlm.model.quantized.fake_quant import FakeQuantLinear
    from leanlm.train.qat import attach_fake_quant, detach_fake_quant

    cfg = tiny_config(256)
    model = build_model(cfg, tiny_state_dict(cfg), torch.float32)
    with pytest.raises(ValueError, match="quantize first"):
        attach_fake_quant(model)
    compress(model, RTNConfig(bits=8), progress=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert attach_fake_quant(model) == 14
    assert sum(isinstance(m, FakeQuantLinear) for m in model.modules()) == 14
    assert detach_fake_quant(model) == 14
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
