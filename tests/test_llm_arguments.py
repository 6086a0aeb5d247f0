"""The public calls refuse the wrong kind of object with a TypeError that names the right call (a bare network
where a Checkpoint goes, a loaded model where a path goes, a dict where SamplingParams go), before they do
anything: nothing is written or loaded."""

from __future__ import annotations

import pytest
import torch

import leanlm
from leanlm import LLM, BeamSearchParams, SamplingParams
from leanlm.compress import RTNConfig, compress
from leanlm.formats import Checkpoint, load_checkpoint
from leanlm.model.llama import build_model
from tests.conftest import tiny_config, tiny_state_dict


@pytest.fixture
def saved(tokenizer, tmp_path):
    cfg = tiny_config(tokenizer.vocab_size)
    ckpt = Checkpoint(build_model(cfg, tiny_state_dict(cfg), torch.float32), tokenizer)
    return leanlm.save_checkpoint(ckpt, tmp_path / "tiny", dtype=torch.float32)


def test_saving_a_loaded_model_names_the_checkpoint_call(saved, tmp_path):
    model = leanlm.load_model(str(saved), progress=False)  # the call older docs paired with save_checkpoint
    with pytest.raises(TypeError, match=r"save_checkpoint takes a Checkpoint, got LlamaForCausalLM; wrap the model: "):
        leanlm.save_checkpoint(model, tmp_path / "copy")
    assert not (tmp_path / "copy").exists()
    leanlm.save_checkpoint(leanlm.load_checkpoint(str(saved), progress=False), tmp_path / "copy")  # the right call
    assert load_checkpoint(str(tmp_path / "copy"), progress=False).tokenizer is not None


def test_a_checkpoint_refuses_a_checkpoint_or_a_foreign_tokenizer(saved):
    ckpt = load_checkpoint(str(saved), progress=False)
    with pytest.raises(TypeError, match="already a Checkpoint"):
        Checkpoint(ckpt, ckpt.tokenizer)
    with pytest.raises(TypeError, match="tokenizer is a leanlm Tokenizer"):
        Checkpoint(ckpt.model, "HuggingFaceTB/SmolLM2-135M")


def test_compress_takes_the_network(saved):
    ckpt = load_checkpoint(str(saved), progress=False)
    with pytest.raises(TypeError, match=r"compress takes a leanlm model .* compress\(checkpoint.model, ...\)"):
        compress(ckpt, [RTNConfig(bits=8)], progress=False)
    with pytest.raises(TypeError, match=r"load_model\(name_or_path\)"):
        compress("smollm2-135m", [RTNConfig(bits=8)], progress=False)


def test_loaders_take_a_name_or_path(saved):
    ckpt = load_checkpoint(str(saved), progress=False)
    for call, name in ((LLM, "LLM"), (leanlm.load_model, "load_model"), (load_checkpoint, "load_checkpoint")):
        with pytest.raises(TypeError, match=rf"{name} takes a model name or path, got Checkpoint; .*save_checkpoint"):
            call(ckpt)
        with pytest.raises(TypeError, match=r"Checkpoint\(model, tokenizer\)"):
            call(ckpt.model)


def test_generate_and_beam_search_take_their_params(saved):
    llm = LLM(str(saved), dtype="float32", device="cpu", progress=False, kv_cache_memory_bytes=4 << 20)
    with pytest.raises(TypeError, match=r"SamplingParams\(\*\*options\)"):
        llm.generate("hi", {"temperature": 0.0})
    with pytest.raises(TypeError, match=r"llm.beam_search\(prompts, params\)"):
        llm.generate("hi", BeamSearchParams(beam_width=2))
    with pytest.raises(TypeError, match="must all be SamplingParams, got dict"):
        llm.generate(["a", "b"], [SamplingParams(), {"temperature": 0.0}])
    with pytest.raises(TypeError, match="beam_search takes a BeamSearchParams"):
        llm.beam_search("hi", SamplingParams())
    out = llm.generate("hi", SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) <= 2
