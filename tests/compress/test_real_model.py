"""Compression on the real bundled SmolLM2: quality against the float model, and a quantized checkpoint
written by `leanlm quantize` served by `leanlm serve` and queried with the openai client."""

import dataclasses
import socket

import pytest
import torch

from leanlm.compress import (
    AWQConfig,
    FP8Config,
    GPTQConfig,
    LLMInt8Config,
    RTNConfig,
    SmoothQuantConfig,
    calibration_samples,
    compress,
    read_calibration_text,
)
from leanlm.formats.checkpoint import Checkpoint
from leanlm.model.llama import build_model
from leanlm.model.quantized.numerics import sqnr_db
from tests.compress.conftest import dense_logits

TEXT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named "
    "after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889."
)

pytestmark = pytest.mark.real_model  # the bundled model throughout


@pytest.fixture(scope="module")
def calib_ids(smollm):
    text = read_calibration_text()
    return calibration_samples(smollm.tokenizer.encode(text[:400_000], add_special_tokens=False), 16, 128)


@pytest.fixture(scope="module")
def eval_ids(smollm):
    return torch.tensor([smollm.tokenizer.encode(TEXT, add_special_tokens=False)])


def _kl(ref_logits, logits) -> float:
    p = torch.log_softmax(ref_logits.double(), -1)
    q = torch.log_softmax(logits.double(), -1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


def test_calibration_text_is_clean_wikipedia_prose():
    text = read_calibration_text()
    assert len(text) > 1_000_000
    assert "{{" not in text and "[[" not in text and "<ref" not in text
    assert "Anarchism is a political philosophy" in text


def test_int8_weight_only_tracks_the_float_model(smollm, eval_ids):
    model = build_model(smollm.config, smollm.state_dict, torch.float32)
    ref = dense_logits(model, eval_ids)
    compress(model, [RTNConfig(bits=8, group_size=None)], None, progress=False)
    out = dense_logits(model, eval_ids)
    assert sqnr_db(ref, out) > 25
    assert _kl(ref, out) < 0.01


def test_gptq_is_closer_to_float_than_rtn_at_3_bits(smollm, calib_ids, eval_ids):
    kls = {}
    for cfg in (RTNConfig(bits=3, group_size=64), GPTQConfig(bits=3, group_size=64)):
        model = build_model(smollm.config, smollm.state_dict, torch.float32)
        ref = dense_logits(model, eval_ids)
        report = compress(model, [cfg], calib_ids, progress=False)
        assert len(report.linears) == 30 * 7
        kls[cfg.name] = _kl(ref, dense_logits(model, eval_ids))
    assert kls["gptq"] < 0.9 * kls["rtn"], kls  # measured 1.55 vs 1.80 (16 x 128 calibration tokens)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_quantized_checkpoint_is_served(tmp_path):
    """`leanlm quantize` (CLI) writes it; `leanlm serve --model DIR` (a real process) answers through openai."""
    openai = pytest.importorskip("openai")
    from leanlm.analysis.peers import leanlm_server
    from leanlm.cli import main

    out = tmp_path / "w8"
    assert main(["quantize", "--method", "rtn", "--bits", "8", "--out", str(out), "--device", "cpu"]) == 0
    assert (out / "quantization_config.json").is_file() and (out / "tokenizer.json").is_file()
    port = _free_port()
    with leanlm_server(str(out), port, ("--dtype", "bfloat16", "--kv-cache-memory-bytes", str(64 << 20))) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        # A completion whose first token leads by ~2.5 nats in float32: bf16 rounding cannot flip it (the chat
        # answer's first token is a 0.08-nat tie, which CPUs round either way).
        reply = client.completions.create(
            model=str(out), prompt="The capital of France is", max_tokens=4, temperature=0
        )
        assert reply.choices[0].text.startswith(" Paris")


@pytest.mark.parametrize(
    "recipe,max_kl",
    [
        ([SmoothQuantConfig(alpha=0.5), RTNConfig(bits=8, act_bits=8)], 0.03),  # measured 0.010
        ([LLMInt8Config()], 0.05),  # 0.018
        ([FP8Config()], 0.1),  # 0.045
        ([AWQConfig(bits=4, group_size=64), RTNConfig(bits=4, group_size=64)], 0.35),  # 0.17
    ],
    ids=["smoothquant-w8a8", "llm_int8", "fp8", "awq-w4"],
)
def test_methods_on_the_real_model(smollm, eval_ids, recipe, max_kl):
    """Each method end to end on SmolLM2 with a little calibration data: logits stay close to float."""
    text = read_calibration_text()[:100_000]
    calib = calibration_samples(smollm.tokenizer.encode(text, add_special_tokens=False), 4, 64)
    model = build_model(smollm.config, smollm.state_dict, torch.float32)
    ref = dense_logits(model, eval_ids)
    compress(model, recipe, calib, progress=False)
    assert _kl(ref, dense_logits(model, eval_ids)) < max_kl


def _first_layers(checkpoint, n: int):
    """The real model cut to its first n decoder layers (real weights, a fraction of the compression time)."""
    import dataclasses

    cfg = dataclasses.replace(checkpoint.config, num_hidden_layers=n)
    keep = {
        k: v for k, v in checkpoint.state_dict.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < n
    }
    return build_model(cfg, keep, torch.float32)


def test_pruning_methods_rank_as_in_their_papers_on_real_weights(smollm, calib_ids, eval_ids):
    """50% and 2:4 on SmolLM2's first 2 layers: SparseGPT's OBS update beats Wanda, which beats magnitude,
    at the logits (KL against the unpruned cut model)."""
    from leanlm.compress import MagnitudeConfig, SparseGPTConfig, WandaConfig

    for pattern in (None, "2:4"):
        kls = {}
        for cfg in (MagnitudeConfig(pattern=pattern), WandaConfig(pattern=pattern), SparseGPTConfig(pattern=pattern)):
            model = _first_layers(smollm, 2)
            ref = dense_logits(model, eval_ids)
            compress(model, cfg, calib_ids, progress=False)
            kls[cfg.name] = _kl(ref, dense_logits(model, eval_ids))
        assert kls["sparsegpt"] < kls["wanda"] < kls["magnitude"], (pattern, kls)


def test_owl_prunes_the_smollm_layer_with_the_most_outliers_least(smollm, calib_ids):
    """SmolLM2's layer 0 holds about 3x the outlier share of layers 1-3 (1.5% against 0.5-0.6% of its Wanda
    scores above 5x their mean): OWL prunes it least, and the 4 layers together at the target."""
    from leanlm.compress import WandaConfig

    model = _first_layers(smollm, 4)
    report = compress(model, WandaConfig(sparsity=0.5, profile="owl", pack=False), calib_ids, progress=False)
    zeros = []
    for layer in model.model.layers:
        weights = [m.weight for m in layer.modules() if isinstance(m, torch.nn.Linear)]
        zeros.append(sum(int((w == 0).sum()) for w in weights) / sum(w.numel() for w in weights))
    assert zeros[0] == min(zeros) < 0.45 < 0.5 < min(zeros[1:]), zeros
    assert sum(zeros) / 4 == pytest.approx(0.5, abs=0.002)
    assert report.details["wanda"]["OWL layer sparsity min"] == pytest.approx(zeros[0], abs=0.002)


def test_24_pruned_smollm_decodes_on_the_sparse_kernel_like_its_dense_copy(smollm, tmp_path):
    """SmolLM2 magnitude-pruned to 2:4, saved once as float weights with zeros and once packed (Sparse24Linear):
    greedy decode through the engine (batch 1, the native loop) gives the same tokens and logprobs, since the
    2:4 kernel computes exactly the bf16 GEMV of the widened weight."""
    from leanlm import LLM, SamplingParams
    from leanlm.compress import MagnitudeConfig
    from leanlm.compress.prune.pruner import pack_semi_structured
    from leanlm.formats import save_checkpoint
    from leanlm.model.linear.sparse24 import Sparse24Linear

    model = build_model(smollm.config, smollm.state_dict, torch.bfloat16)
    compress(model, MagnitudeConfig(pattern="2:4", pack=False), progress=False)
    save_checkpoint(Checkpoint(model, smollm.tokenizer), tmp_path / "zeros")
    pack_semi_structured(model, [])
    save_checkpoint(Checkpoint(model, smollm.tokenizer), tmp_path / "packed")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = {}
    for name in ("zeros", "packed"):
        llm = LLM(str(tmp_path / name), dtype="bfloat16", progress=False)
        linears = [m for n, m in llm.llm_engine.model.named_modules() if n.endswith("mlp.down_proj")]
        assert all(isinstance(m, Sparse24Linear) for m in linears) == (name == "packed")
        out = llm.generate([TEXT[:60]], params, use_tqdm=False)[0].outputs[0]
        outs[name] = (out.token_ids, [lp[tok] for lp, tok in zip(out.logprobs, out.token_ids, strict=True)])
    assert outs["packed"] == outs["zeros"]


def test_teal_smollm_skips_two_fifths_of_its_inputs_and_still_answers(smollm, calib_ids, tmp_path):
    """SmolLM2 with 40% activation sparsity (TEAL) saved and served: every decoder linear is ActSparseLinear, the
    calibration rows read at batch 1 are 60%, batch-1 decode runs on the skipping kernel in the native loop (where
    the CPU has one: AVX512-BF16; elsewhere the PyTorch path), and the greedy continuation of a plain fact keeps its
    answer."""
    from leanlm import LLM, SamplingParams
    from leanlm.compress import ActivationSparsityConfig
    from leanlm.formats import save_checkpoint
    from leanlm.model.linear.act_sparse import ActSparseLinear

    model = build_model(smollm.config, smollm.state_dict, torch.bfloat16)
    report = compress(model, ActivationSparsityConfig(sparsity=0.4), calib_ids[:4], progress=False)
    assert report.details["act-sparsity"]["weight rows read at batch 1"] == pytest.approx(0.6, abs=0.01)
    save_checkpoint(Checkpoint(model, smollm.tokenizer), tmp_path / "teal")
    llm = LLM(str(tmp_path / "teal"), dtype="bfloat16", progress=False)
    served = llm.llm_engine.model
    assert sum(isinstance(m, ActSparseLinear) for m in served.modules()) == 7 * served.config.num_hidden_layers
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
    from leanlm.kernels import cpu_act_sparse, cpu_decode

    if cpu_decode.is_available() and cpu_act_sparse.is_available():  # the native loop needs AVX512-BF16
        loop = served.native_decode_plan().loop
        assert loop is not None and {lin.name for layer in loop._keep[0] for lin in layer.linears} == {"act_sparse"}


@pytest.mark.parametrize("kind", ["sparse24_int8", "sparse24_int4", "sparse_bitmask"])
def test_sparse_formats_on_smollm_decode_on_their_kernels_like_their_dense_copies(smollm, tmp_path, kind):
    """SmolLM2 pruned (2:4 then RTN int8 / int4, or 70% unstructured), saved once unpacked (dense layers with zeros)
    and once packed: each loads into its format, decodes in the native loop on its kernel, and answers as the
    unpacked copy does. The prompt's logits run the same packed GEMM (the first token and its logprob equal bit
    for bit); decode runs the sparse kernel, bit for bit the dense GEMV for bf16 (every token equal), within bf16
    rounding of the dense quantized kernels otherwise (logprobs of the first steps close)."""
    from leanlm import LLM, SamplingParams
    from leanlm.compress import MagnitudeConfig, RTNConfig
    from leanlm.formats import save_checkpoint
    from leanlm.kernels import cpu_bitmask, cpu_decode, cpu_sparse

    recipes = {
        "sparse24_int8": (MagnitudeConfig(pattern="2:4"), RTNConfig(bits=8, group_size=None)),
        "sparse24_int4": (MagnitudeConfig(pattern="2:4"), RTNConfig(bits=4, group_size=64)),
        "sparse_bitmask": (MagnitudeConfig(sparsity=0.7),),
    }
    loop_kind = {  # without VBMI2 the layers run their dense copies: dense int8 / int4 codes, a bf16 weight
        "sparse24_int8": "sparse24_int8" if cpu_sparse.quant_is_available() else "int8",
        "sparse24_int4": "sparse24_int4" if cpu_sparse.quant_is_available() else "int4",
        "sparse_bitmask": "bitmask" if cpu_bitmask.is_available() else "bf16",
    }[kind]
    prune, *quantize = recipes[kind]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = {}
    for packed in (False, True):
        model = build_model(smollm.config, smollm.state_dict, torch.bfloat16)
        compress(model, [dataclasses.replace(prune, pack=packed), *quantize], progress=False)
        save_checkpoint(Checkpoint(model, smollm.tokenizer), tmp_path / str(packed))
        # 16-bit activations on both sides: the sparse kernels have no int8-activation path (the dense codes do)
        llm = LLM(str(tmp_path / str(packed)), dtype="bfloat16", progress=False, act_quant="none")
        served = llm.llm_engine.model
        formats = {m.format for n, m in served.named_modules() if n.endswith("_proj") and hasattr(m, "format")}
        assert (formats == {kind}) == packed, formats
        out = llm.generate([TEXT[:60]], params, use_tqdm=False)[0].outputs[0]
        outs[packed] = (out.token_ids, [lp[tok] for lp, tok in zip(out.logprobs, out.token_ids, strict=True)])
        if packed and cpu_decode.is_available():  # the native loop needs AVX512-BF16
            loop = served.native_decode_plan().loop
            assert loop is not None and {lin.name for layer in loop._keep[0] for lin in layer.linears} == {loop_kind}
    (dense_ids, dense_lps), (ids, lps) = outs[False], outs[True]
    assert ids[0] == dense_ids[0] and lps[0] == dense_lps[0]
    if kind == "sparse_bitmask":
        assert outs[True] == outs[False]
    else:
        same = next((i for i, (a, b) in enumerate(zip(ids, dense_ids, strict=True)) if a != b), len(ids))
        assert all(abs(a - b) < 0.1 for a, b in zip(lps[:same], dense_lps[:same], strict=True))
