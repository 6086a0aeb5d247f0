"""A sparse checkpoint LeanLM wrote in the compressed-tensors layout, read by compressed-tensors' own
decompressor into HF transformers' Llama: its logits against LeanLM's on the same checkpoint.

compressed-tensors dropped the sparse compressors after 0.12 (0.20 lists the formats as legacy), so the check
runs against 0.12.2, installed aside:

    pip install --no-deps --target /tmp/ct12 compressed-tensors==0.12.2 loguru
    leanlm prune --method sparsegpt --pattern 2:4 --format compressed-tensors --out smol-24-ct
    PYTHONPATH=/tmp/ct12:. python benchmarks/compressed_tensors_check.py smol-24-ct
"""

import sys

import torch
import transformers
from compressed_tensors.compressors import ModelCompressor
from safetensors.torch import load_file

from leanlm.llm import load_model
from tests.compress.conftest import dense_logits

path = sys.argv[1]
cfg = transformers.AutoConfig.from_pretrained(path)
qc = cfg.quantization_config
qc = qc if isinstance(qc, dict) else qc.to_dict()
compressor = ModelCompressor.from_compression_config(qc)
print("compressor:", type(compressor.sparsity_compressor).__name__)
cfg_plain = transformers.AutoConfig.from_pretrained(path)
del cfg_plain.quantization_config
hf = transformers.AutoModelForCausalLM.from_config(cfg_plain, dtype=torch.float32)
dense = {
    k: v.float() for k, v in load_file(path + "/model.safetensors").items() if k.split(".")[-1] in ("weight", "bias")
}
missing, unexpected = hf.load_state_dict(dense, strict=False)
print("dense tensors loaded:", len(dense), "missing (the sparse weights, tied head):", len(missing))
compressor.decompress(path, hf)
hf = hf.float().eval()
ours = load_model(path, dtype="float32", progress=False)
ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    ref = hf(ids).logits[0]
    mine = dense_logits(ours, ids)[0]
print("max |diff|", float((ref - mine).abs().max()), "max |logit|", float(ref.abs().max()))
