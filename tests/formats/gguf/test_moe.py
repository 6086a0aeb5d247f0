"""Mixtral, Qwen2-MoE and OLMoE GGUF files, written by gguf-py's GGUFWriter as llama.cpp's converter lays them out
(tests/formats/gguf/moe_gguf.py), load with the logits of HF transformers' own classes (float64, within 1e-5)."""

import dataclasses

import pytest
import torch

from leanlm.config import ModelConfig
from leanlm.config.moe import MoEConfig
from leanlm.formats.gguf import load_gguf, read_gguf
from leanlm.formats.gguf.moe import expert_parts, gguf_moe_config, moe_architecture
from leanlm.loading.errors import ModelLoadError
from leanlm.model.linear.int8 import Int8WeightOnlyLinear
from leanlm.model.linear.int_group import IntGroupWeightOnlyLinear
from leanlm.model.llama import build_model
from tests.formats.gguf.moe_gguf import write_moe_gguf
from tests.model.test_llama import _paged_logits
from tests.model.test_moe_hf import hf_logits, hf_model

pytest.importorskip("transformers")

IDS = torch.randint(0, 101, (19,), generator=torch.Generator().manual_seed(3))


def _logits(config, state):
    model = build_model(config, state, torch.float64)
    return _paged_logits(model, IDS, [8, 1, 6, 4], list(range(16)))


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe", "qwen2_moe_norm", "olmoe"])
def test_f32_gguf_matches_hf(case, tmp_path):
    hf = hf_model(case)
    path = tmp_path / f"{case}.gguf"
    encoded = write_moe_gguf(path, hf, "F32", write_norm_key=case == "qwen2_moe_norm")
    config, state, _ = load_gguf(path, dtype=torch.float64, progress=False)
    want = ModelConfig.from_hf_dict(hf.config.to_dict())
    assert config.architecture == want.architecture and config.moe == dataclasses.replace(
        want.moe, router_aux_loss_coef=0
    )
    assert (config.qk_norm, config.clip_qkv, config.attention_bias) == (
        want.qk_norm,
        want.clip_qkv,
        want.attention_bias,
    )
    assert set(state) == set(encoded)
    for name, tensor in encoded.items():  # llama Q/K come back un-permuted, experts split, the shared gate [1, hidden]
        torch.testing.assert_close(state[name], tensor, atol=0, rtol=0, msg=name)
    torch.testing.assert_close(_logits(config, state), hf_logits(hf, IDS), atol=1e-5, rtol=0)


def test_qwen2moe_without_norm_key_runs_llama_cpps_numbers(tmp_path):
    """convert_hf_to_gguf.py drops norm_topk_prob and llama.cpp's qwen2moe graph never renormalises: we load what
    llama.cpp computes, which is not HF's model when norm_topk_prob was true."""
    hf = hf_model("qwen2_moe_norm")
    write_moe_gguf(tmp_path / "q.gguf", hf, "F32")
    config, state, _ = load_gguf(tmp_path / "q.gguf", dtype=torch.float64, progress=False)
    assert config.moe.scoring == "softmax"
    ours = _logits(config, state)
    assert (ours - hf_logits(hf, IDS)).abs().max() > 1e-3
    renormalised = dataclasses.replace(config, moe=dataclasses.replace(config.moe, scoring="softmax_renorm"))
    torch.testing.assert_close(_logits(renormalised, state), hf_logits(hf, IDS), atol=1e-5, rtol=0)


@pytest.mark.parametrize("case,qtype,layer", [("mixtral", "Q8_0", Int8WeightOnlyLinear),
                                               ("olmoe", "Q4_0", IntGroupWeightOnlyLinear),
                                               ("qwen2_moe", "Q8_0", Int8WeightOnlyLinear)])  # fmt: skip
def test_quantized_experts_load_as_codes_per_expert(case, qtype, layer, tmp_path):
    hf = hf_model(case)
    path = tmp_path / f"{case}-{qtype}.gguf"
    encoded = write_moe_gguf(path, hf, qtype)
    config, state, _ = load_gguf(path, dtype=torch.float64, progress=False)
    for name, tensor in encoded.items():  # dequantized: gguf's own dequantization of each expert, exactly
        torch.testing.assert_close(state[name], tensor, atol=0, rtol=0, msg=name)
    coded_config, floats, coded, _ = read_gguf(path, torch.float64, progress=False, dequantize_gguf=False)
    experts = [n for n in coded if ".mlp.experts." in n]
    assert len(experts) == 3 * config.moe.num_experts * len([i for i in range(3) if config.moe.is_sparse(i)])
    assert all(isinstance(coded[n], layer) for n in experts)
    assert "model.layers.0.mlp.gate.weight" in floats and not any(n.endswith(".mlp.gate") for n in coded)
    from_codes = build_model(coded_config, floats, torch.float64, quantized=coded)
    got = _paged_logits(from_codes, IDS, [8, 1, 6, 4], list(range(16)))
    dequantized = _logits(config, state)
    torch.testing.assert_close(got, dequantized, atol=1e-4, rtol=0)
    # the file's rounding moves the logits from HF's float model by about what it rounds the weights
    ref = hf_logits(hf, IDS)
    assert (dequantized - ref).norm() / ref.norm() < {"Q8_0": 0.02, "Q4_0": 0.3}[qtype]


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_early_mixtral_files_with_one_tensor_per_expert(qtype, tmp_path):
    hf = hf_model("mixtral")
    encoded = write_moe_gguf(tmp_path / "old.gguf", hf, qtype, legacy_experts=True)
    config, state, _ = load_gguf(tmp_path / "old.gguf", dtype=torch.float64, progress=False)
    assert config.architecture == "mixtral" and set(state) == set(encoded)
    if qtype == "F32":
        torch.testing.assert_close(_logits(config, state), hf_logits(hf, IDS), atol=1e-5, rtol=0)
    _, _, coded, _ = read_gguf(tmp_path / "old.gguf", torch.float64, progress=False, dequantize_gguf=qtype == "F32")
    assert (qtype != "F32") == isinstance(coded.get("model.layers.2.mlp.experts.5.down_proj"), Int8WeightOnlyLinear)


def test_llama_file_with_experts_is_mixtral_and_others_are_refused():
    fields = {"llama.expert_count": 8}
    assert moe_architecture("llama", fields.get) == "mixtral"
    assert moe_architecture("llama", {}.get) == "llama"
    assert moe_architecture("qwen2moe", {}.get) == "qwen2_moe"
    assert moe_architecture("deepseek2", {}.get) == "deepseek_v3"  # V2's files read as V2 by their gating (read_gguf)
    with pytest.raises(ModelLoadError, match="falcon.*not supported.*deepseek2"):
        moe_architecture("falcon", {}.get)


def _moe(fields: dict, arch: str = "qwen2moe", layers: int = 2, shared: bool = True) -> MoEConfig | None:
    names = {f"blk.{i}.ffn_gate_inp.weight" for i in range(layers)}
    if shared:
        names |= {f"blk.{i}.{t}.weight" for i in range(layers) for t in ("ffn_up_shexp", "ffn_gate_inp_shexp")}
    base = {f"{arch}.expert_count": 4, f"{arch}.expert_used_count": 2, f"{arch}.feed_forward_length": 64}
    return gguf_moe_config(arch, {**base, **fields}.get, names, layers)


def test_moe_metadata_rules():
    # llama.cpp's fallbacks: expert width n_ff / k, shared width n_ff; softmax unless the file says to renormalise
    assert _moe({}) == MoEConfig(4, 2, 32, "softmax", 64, True)
    assert _moe({"qwen2moe.expert_feed_forward_length": 16, "qwen2moe.expert_weights_norm": True}).scoring == (
        "softmax_renorm"
    )
    assert _moe({}, arch="llama", shared=False).scoring == "softmax_renorm"  # Mixtral's graph renormalises
    for bad, match in [
        ({"qwen2moe.expert_gating_func": 2}, "gating function"),
        ({"qwen2moe.expert_weights_scale": 2.5}, "expert_weights_scale"),
        ({"qwen2moe.expert_used_count": 0}, "expert_used_count"),
        ({"qwen2moe.expert_used_count": 5}, "invalid MoE"),
    ]:
        with pytest.raises(ModelLoadError, match=match):
            _moe(bad)
    with pytest.raises(ModelLoadError, match="Granite"):
        _moe({}, arch="llama")
    assert _moe({"llama.expert_count": 0}, arch="llama") is None


def test_expert_tensor_must_match_the_metadata():
    config = ModelConfig(architecture="mixtral", vocab_size=10, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=64, moe=MoEConfig(4, 2, 64))  # fmt: skip
    data = torch.zeros(4, 64, 32).numpy()
    parts = expert_parts("blk.1.ffn_up_exps.weight", (4, 64, 32), data, config)
    assert [p[0] for p in parts] == [f"model.layers.1.mlp.experts.{e}.up_proj.weight" for e in range(4)]
    assert parts[2][2] == (64, 32) and parts[2][1].base is not None  # a view of the file, not a copy
    with pytest.raises(ModelLoadError, match="4 experts"):
        expert_parts("blk.1.ffn_up_exps.weight", (3, 64, 32), data[:3], config)
    with pytest.raises(ModelLoadError, match="gives layer 1 none"):
        dense = dataclasses.replace(config, architecture="llama", moe=MoEConfig(4, 2, 64, sparse_layers=(0,)))
        expert_parts("blk.1.ffn_up_exps.weight", (4, 64, 32), data, dense)


def _greedy(logits_of, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(logits_of(torch.tensor(out))[-1].argmax()))
    return out[len(ids) :]


@pytest.mark.parametrize("case,qtype", [("mixtral", "F32"), ("qwen2_moe", "F32"), ("olmoe", "Q8_0")])
def test_llm_serves_a_moe_gguf(case, qtype, tmp_path):
    """The engine runs the file (experts as Q8_0 codes, when so written), batched, with HF's greedy tokens (F32)."""
    from leanlm import LLM, SamplingParams

    hf = hf_model(case)
    path = tmp_path / f"{case}.gguf"
    encoded = write_moe_gguf(path, hf, qtype)
    llm = LLM(str(path), dtype="float32", progress=False)
    prompts = [IDS[:7].tolist(), IDS[3:15].tolist(), IDS[10:12].tolist()]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    def reference(ids):  # F32: HF's model; Q8_0: the file's weights dequantized, in float64
        if qtype == "F32":
            return hf_logits(hf, ids)
        return _paged_logits(model, ids, [len(ids)], list(range(16)))

    model = build_model(ModelConfig.from_hf_dict(hf.config.to_dict()), encoded, torch.float64)
    assert got == [_greedy(reference, ids, 6) for ids in prompts]
