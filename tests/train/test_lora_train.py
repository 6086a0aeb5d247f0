"""LoRA training: only the adapters' pairs move, on a float base and on an int4 base (QLoRA, whose layers take no
float copy); a run resumes to the uninterrupted result; what it writes PEFT loads with our logits, and our engine
serves with the training forward's logits."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from leanlm.compress import RTNConfig, compress
from leanlm.config import EngineConfig
from leanlm.engine import LLMEngine
from leanlm.formats.hf_dir import load_hf_dir
from leanlm.formats.peft import read_adapter, write_adapter
from leanlm.lora_request import LoRARequest
from leanlm.model.forward import logits
from leanlm.model.linear.base import RuntimeLinear
from leanlm.model.llama import build_model
from leanlm.sampling_params import SamplingParams
from leanlm.train.lora import LoRALinear, LoRAObjective, LoRATrainConfig, attach_lora, lora_weights
from leanlm.train.trainer import TrainConfig, Trainer
from tests.conftest import run_to_completion
from tests.train.conftest import SEQ_LEN, run_interrupted

CONFIG = TrainConfig(tokens=SEQ_LEN * 4 * 2 * 6, seq_len=SEQ_LEN, lr=1e-2, warmup_steps=0, dtype="float32",
                     eval_every=0, save_every=2)  # fmt: skip


def _train(model, windows, lora: LoRATrainConfig, state=None, config=CONFIG):
    attach_lora(model, lora)
    trainer = Trainer(model, windows, config, None, state, progress=False, objective=LoRAObjective(lora))
    return trainer, trainer.run()


def _frozen(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}


@pytest.mark.parametrize("int4", [False, True])
def test_only_the_pairs_train_and_the_loss_falls(tiny_model, windows, int4):
    model = tiny_model()
    if int4:
        compress(model, [RTNConfig(bits=4, group_size=32)], progress=False)
        assert isinstance(model.model.layers[0].self_attn.q_proj, RuntimeLinear)
    base = _frozen(model)
    lora = LoRATrainConfig(r=4, targets=("q_proj", "v_proj", "down_proj"))
    trainer, result = _train(model, windows, lora)
    assert result.losses[-1] < 0.9 * result.losses[0]
    after = {k.replace(".base.", "."): v for k, v in model.state_dict().items()}
    assert all(torch.equal(after[k], v) for k, v in base.items())  # base weights (int4 codes, scales) untouched
    pairs = lora_weights(model)
    assert len(pairs) == 2 * 3 and all(b.abs().max() > 0 for _, b in pairs.values())
    trained = {id(p) for p in trainer.optimizer.param_groups[0]["params"] + trainer.optimizer.param_groups[1]["params"]}
    assert trained == {id(p) for m in model.modules() if isinstance(m, LoRALinear) for p in (m.lora_A, m.lora_B)}


def test_the_int4_base_backward_equals_its_dequantized_weights(tiny_model):
    model = tiny_model()
    compress(model, [RTNConfig(bits=4, group_size=32)], progress=False)
    layer = model.model.layers[0].mlp.down_proj
    wrapped = LoRALinear(layer, 4, 2.0, torch.Generator().manual_seed(0))
    x = torch.randn(2, 5, layer.in_features, dtype=torch.float64, requires_grad=True)
    x32 = x.detach().float().requires_grad_(True)
    wrapped(x32).pow(2).sum().backward()
    w = layer.dequantized_weight().double()
    a, b = wrapped.lora_A.detach().double(), wrapped.lora_B.detach().double()
    (x @ w.T + 2.0 * (x @ a.T) @ b.T).pow(2).sum().backward()
    torch.testing.assert_close(x32.grad.double(), x.grad, atol=1e-3, rtol=1e-4)


def test_an_interrupted_run_resumes_to_the_uninterrupted_result(tiny_model, windows, tmp_path):
    lora = LoRATrainConfig(r=2)
    _, whole = _train(tiny_model(), windows, lora)
    full_model = tiny_model()
    _train(full_model, windows, lora)
    state = tmp_path / "state.pt"
    model = tiny_model()
    attach_lora(model, lora)
    trainer = Trainer(model, windows, CONFIG, None, state, progress=False, objective=LoRAObjective(lora))
    run_interrupted(trainer.run, at_step=3)
    resumed_model = tiny_model()
    _, resumed = _train(resumed_model, windows, lora, state)
    assert resumed.resumed_from == 2 and resumed.losses == whole.losses
    for name, (a, b) in lora_weights(full_model).items():
        ra, rb = lora_weights(resumed_model)[name]
        torch.testing.assert_close((ra, rb), (a, b), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="other settings"):
        _train(tiny_model(), windows, LoRATrainConfig(r=3), state)


@pytest.mark.parametrize("int4", [False, True])
def test_the_engine_serves_a_trained_adapter_with_the_training_forwards_logits(tiny_model, windows, tokenizer, int4,
                                                                               tmp_path):  # fmt: skip
    import dataclasses

    from tests.conftest import tiny_config, tiny_state_dict

    config = tiny_config(tokenizer.vocab_size)
    state = tiny_state_dict(config)
    model = build_model(config, state, torch.float32)
    served = build_model(config, state, torch.float32)
    if int4:
        for m in (model, served):
            compress(m, [RTNConfig(bits=4, group_size=32)], progress=False)
    lora = LoRATrainConfig(r=4)
    data = dataclasses.replace(windows, train=windows.train % tokenizer.vocab_size)
    _train(model, data, lora, config=dataclasses.replace(CONFIG, tokens=SEQ_LEN * 8 * 2))
    path = write_adapter(tmp_path / "adapter", lora_weights(model), lora.r, lora.alpha, "tiny")
    prompt = windows.held_out[0, :20]
    with torch.no_grad():
        want = torch.log_softmax(logits(model.eval(), prompt[None])[0, :-1].float(), -1)
    # exact int4 products, as training runs them (auto would quantize the activations to int8 on this CPU)
    options = EngineConfig.from_options(enable_lora=True, num_kv_blocks=32, block_size=4, act_quant="none")
    engine = LLMEngine(served, tokenizer, options, torch.device("cpu"), torch.float32)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, full_prompt_logprobs=True)
    engine.add_request(prompt.tolist(), params, lora_request=LoRARequest("trained", str(path)))
    (out,) = run_to_completion(engine).values()
    torch.testing.assert_close(out.prompt_logprobs_full, want, atol=1e-4, rtol=0)


def test_peft_loads_what_we_trained_with_our_logits(tokenizer, windows, tmp_path):
    peft = pytest.importorskip("peft")
    from tests.formats.test_peft import reference, tiny_hf

    hf = tiny_hf(tokenizer.vocab_size)
    hf.save_pretrained(tmp_path / "base")
    config, state = load_hf_dir(tmp_path / "base", dtype=torch.float32, progress=False)
    ours = build_model(config, state, torch.float32)
    lora = LoRATrainConfig(r=4, alpha=4.0, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"))
    import dataclasses

    data = dataclasses.replace(windows, train=windows.train % tokenizer.vocab_size)
    _train(ours, data, lora, config=dataclasses.replace(CONFIG, tokens=SEQ_LEN * 8 * 2))
    path = write_adapter(tmp_path / "adapter", lora_weights(ours), lora.r, lora.alpha, str(tmp_path / "base"))
    assert json.loads((path / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tmp_path / "base")
    model = peft.PeftModel.from_pretrained(copy.deepcopy(hf), str(path)).eval()
    prompt = (windows.held_out[0, :16] % tokenizer.vocab_size).tolist()
    with torch.no_grad():
        ours_logits = torch.log_softmax(logits(ours.eval(), torch.tensor([prompt]))[0, :-1].float(), -1)
    torch.testing.assert_close(ours_logits, reference(model, prompt), atol=1e-4, rtol=0)
    assert read_adapter(path).r == 4


def test_the_train_command_writes_an_adapter_generate_runs(tokenizer, tmp_path, capsys):
    from leanlm.cli import main
    from leanlm.formats import save_checkpoint
    from leanlm.formats.checkpoint import Checkpoint
    from tests.conftest import tiny_config, tiny_state_dict
    from tests.train.test_command import TEXT

    cfg = tiny_config(tokenizer.vocab_size)
    model = build_model(cfg, tiny_state_dict(cfg), torch.float32)
    compress(model, [RTNConfig(bits=4, group_size=32)], progress=False)  # QLoRA: an int4 checkpoint as the base
    base = save_checkpoint(Checkpoint(model, tokenizer), tmp_path / "int4")
    data, out = tmp_path / "text.txt", tmp_path / "adapter"
    data.write_text(TEXT)
    argv = ["train", "--model", str(base), "--lora", "4", "--lora-targets", "q_proj,v_proj", "--lr", "1e-2"]
    argv += ["--data", str(data), "--seq-len", "32", "--tokens", str(32 * 8 * 3), "--out", str(out), "--device", "cpu"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert (
        "LoRA r=4 alpha=8 on q_proj,v_proj on a frozen quantized base (int_group_weight_only: QLoRA), 3 steps"
        in printed
    )
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_modules"] == ["q_proj", "v_proj"] and config["base_model_name_or_path"] == str(base)
    assert main(["generate", "--model", str(base), "--lora", str(out), "--max-tokens", "4", "--json", "hello"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 4
    assert main(["train", "--lora-alpha", "3", "--out", str(tmp_path / "x")]) == 2
    assert "need --lora R" in capsys.readouterr().err
