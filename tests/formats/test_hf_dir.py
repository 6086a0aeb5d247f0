"""HF directories: a sharded round trip of tiny random llama/qwen2 models, and every broken-directory case."""

from __future__ import annotations

import json

import pytest
import torch

from leanlm.config import ModelConfig
from leanlm.formats.hf_dir import expected_tensor_names, load_hf_dir, save_hf_dir
from leanlm.formats.stored import read_checkpoint
from leanlm.loading.errors import ModelLoadError


def tiny_config(arch: str, tied: bool, vocab_size: int = 49152) -> ModelConfig:
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
        attention_bias=arch == "qwen2",
        bos_token_id=1,
        eos_token_ids=(2, 0),
    )


def random_state_dict(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "embed_tokens": (config.vocab_size, config.hidden_size),
        "lm_head": (config.vocab_size, config.hidden_size),
        "q_proj": (config.num_attention_heads * config.head_dim, config.hidden_size),
        "k_proj": (config.num_key_value_heads * config.head_dim, config.hidden_size),
        "v_proj": (config.num_key_value_heads * config.head_dim, config.hidden_size),
        "o_proj": (config.hidden_size, config.num_attention_heads * config.head_dim),
        "gate_proj": (config.intermediate_size, config.hidden_size),
        "up_proj": (config.intermediate_size, config.hidden_size),
        "down_proj": (config.hidden_size, config.intermediate_size),
    }
    out = {}
    for name in expected_tensor_names(config):
        module = name.split(".")[-2]
        shape = shapes.get(module, (config.hidden_size,))  # norms are [hidden]
        if name.endswith(".bias"):
            shape = shape[:1]
        out[name] = torch.randn(shape, generator=g)
    return out


@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False)])
def test_sharded_round_trip(smollm, tmp_path, arch, tied):
    config = tiny_config(arch, tied)
    state_dict = random_state_dict(config)
    total_bytes = sum(t.numel() * t.element_size() for t in state_dict.values())
    save_hf_dir(tmp_path, config, state_dict, max_shard_bytes=int(0.55 * total_bytes))  # -> exactly 2 shards
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2
    smollm.tokenizer.save(tmp_path)  # tokenizers.Tokenizer.save -> tokenizer.json, plus tokenizer_config.json

    ckpt = read_checkpoint(tmp_path, progress=False)
    assert ckpt.config == config and ckpt.source == tmp_path
    assert set(ckpt.state_dict) == set(state_dict)
    for name, tensor in state_dict.items():
        assert torch.equal(ckpt.state_dict[name], tensor), name
    text = "Hello 世界 🤖 <|im_end|>"
    assert ckpt.tokenizer.encode(text) == smollm.tokenizer.encode(text)
    assert ckpt.tokenizer.eos_token_ids == smollm.tokenizer.eos_token_ids
    messages = [{"role": "user", "content": "hi"}]
    assert ckpt.tokenizer.apply_chat_template(messages) == smollm.tokenizer.apply_chat_template(messages)


def test_single_file_and_tied_lm_head_dropped(tmp_path):
    config = tiny_config("llama", tied=True, vocab_size=64)
    state_dict = random_state_dict(config)
    save_hf_dir(tmp_path, config, {**state_dict, "lm_head.weight": state_dict["model.embed_tokens.weight"].clone()})
    assert (tmp_path / "model.safetensors").is_file()
    loaded_config, loaded = load_hf_dir(tmp_path, dtype=torch.bfloat16, progress=False)
    assert loaded_config == config and "lm_head.weight" not in loaded
    assert all(t.dtype == torch.bfloat16 for t in loaded.values())


@pytest.fixture
def hf_dir(tmp_path):
    config = tiny_config("qwen2", tied=False, vocab_size=64)
    save_hf_dir(tmp_path, config, random_state_dict(config), max_shard_bytes=20_000)
    return tmp_path


def test_missing_config(hf_dir):
    (hf_dir / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_hf_dir(hf_dir)


def test_invalid_config(hf_dir):
    (hf_dir / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    with pytest.raises(ModelLoadError, match="not supported"):
        load_hf_dir(hf_dir)


def test_missing_shard(hf_dir):
    shards = sorted(hf_dir.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    with pytest.raises(ModelLoadError, match=f"shard {shards[-1].name} .* is missing"):
        load_hf_dir(hf_dir)


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage"])
def test_corrupt_safetensors(hf_dir, damage):
    shard = sorted(hf_dir.glob("model-*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes({"empty": b"", "truncated": data[: len(data) // 2], "garbage": b"\x00" * 64}[damage])
    with pytest.raises(ModelLoadError, match=f"{shard.name} is corrupt or truncated"):
        load_hf_dir(hf_dir)


def test_missing_tensor(tmp_path):
    config = tiny_config("llama", tied=False, vocab_size=64)
    state_dict = random_state_dict(config)
    del state_dict["model.layers.1.mlp.down_proj.weight"]
    save_hf_dir(tmp_path, config, state_dict)
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.down_proj.weight"):
        load_hf_dir(tmp_path)


def test_no_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config("llama", True).to_hf_dict()))
    with pytest.raises(ModelLoadError, match="neither model.safetensors"):
        load_hf_dir(tmp_path)


def test_extra_and_integer_tensors_kept(tmp_path):
    """Nothing is stripped: extra tensors (e.g. packed quantized weights) come back with their own dtype."""
    config = tiny_config("llama", tied=True, vocab_size=64)
    extra = {"model.layers.0.self_attn.q_proj.qweight": torch.arange(6, dtype=torch.int32)}
    save_hf_dir(tmp_path, config, {**random_state_dict(config), **extra})
    _, loaded = load_hf_dir(tmp_path, progress=False)
    assert torch.equal(
        loaded["model.layers.0.self_attn.q_proj.qweight"], extra["model.layers.0.self_attn.q_proj.qweight"]
    )
    assert loaded["model.norm.weight"].dtype == torch.float32


# ---------------------------------------------------------------------------------------------- hostile index


def _point_first_shard_at(hf_dir, name: str) -> None:
    index_path = hf_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"] = {k: (name if v == first else v) for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))


@pytest.mark.parametrize("how", ["absolute", "dotdot"])
def test_index_shards_must_stay_inside_the_directory(hf_dir, tmp_path_factory, how):
    outside = tmp_path_factory.mktemp("outside")
    first = sorted(hf_dir.glob("model-*.safetensors"))[0]
    (outside / first.name).write_bytes(first.read_bytes())  # a loadable file: only its place is wrong
    if how == "absolute":
        name, match = str(outside / first.name), "outside the model directory"
    else:
        name, match = f"../{outside.name}/{first.name}", "outside the model directory"
    _point_first_shard_at(hf_dir, name)
    with pytest.raises(ModelLoadError, match=match):
        load_hf_dir(hf_dir, progress=False)


def test_index_shard_symlinks_are_followed_as_in_the_hub_cache(hf_dir, tmp_path_factory):
    """The Hugging Face hub cache layout: snapshots/<rev>/<shard> -> ../../blobs/<hash>."""
    blobs = tmp_path_factory.mktemp("blobs")
    shards = list(hf_dir.glob("model-*.safetensors"))
    assert len(shards) > 1
    for shard in shards:
        shard.rename(blobs / shard.name)
        shard.symlink_to(blobs / shard.name)
    _, loaded = load_hf_dir(hf_dir, progress=False)
    assert loaded


@pytest.mark.parametrize("value", [None, 3, ["a"]])
def test_index_shard_names_must_be_strings(hf_dir, value):
    _point_first_shard_at(hf_dir, value)
    with pytest.raises(ModelLoadError, match="not a file name"):
        load_hf_dir(hf_dir, progress=False)


def test_absurd_context_length_is_refused_before_any_allocation(hf_dir):
    raw = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**raw, "max_position_embeddings": 2**40}))
    with pytest.raises(
        ModelLoadError,
        match=r"max_position_embeddings \(context length\) is 1099511627776, above "
        r"the 1048576 positions",
    ):
        load_hf_dir(hf_dir, progress=False)


@pytest.mark.parametrize(
    "first_shard_bytes,second_shard_bytes", [(20_000, 1 << 30), (1 << 30, 20_000), (20_000, 30_000)]
)
def test_saving_over_an_older_model_loads_the_new_weights(tmp_path, first_shard_bytes, second_shard_bytes):
    """The reader takes the index first: an old sharded save's index used to win over a new single file."""
    config = tiny_config("qwen2", tied=False, vocab_size=64)
    save_hf_dir(tmp_path, config, random_state_dict(config, seed=1), max_shard_bytes=first_shard_bytes)
    (tmp_path / "notes.txt").write_text("kept")
    new = random_state_dict(config, seed=2)
    save_hf_dir(tmp_path, config, new, max_shard_bytes=second_shard_bytes)
    _, loaded = load_hf_dir(tmp_path, dtype=None)
    assert all(torch.equal(loaded[name], tensor) for name, tensor in new.items())
    weights = sorted(p.name for p in tmp_path.glob("model*"))
    if second_shard_bytes > 1 << 20:
        assert weights == ["model.safetensors"]
    else:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert weights == sorted({"model.safetensors.index.json", *index["weight_map"].values()})
    assert (tmp_path / "notes.txt").read_text() == "kept"  # only the model's own files are replaced
