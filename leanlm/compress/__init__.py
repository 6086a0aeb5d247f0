"""Compression: one API for every method (torchao style), run through one layer-by-layer loop (calibration.py).
Methods by kind: quantize/, prune/, activation/, transform/; compress() returns a report whose `recipe` a saved
Checkpoint records (leanlm.formats writes it)."""

from leanlm.compress.activation.act_sparsity import ActivationSparsityConfig
from leanlm.compress.base import CompressionReport, LinearReport
from leanlm.compress.calibration import calibration_samples, read_calibration_text
from leanlm.compress.prune.magnitude import MagnitudeConfig
from leanlm.compress.prune.permute import PermuteConfig
from leanlm.compress.prune.sparsegpt import SparseGPTConfig
from leanlm.compress.prune.wanda import WandaConfig
from leanlm.compress.quantize.fp8 import FP8Config
from leanlm.compress.quantize.gptq import GPTQConfig
from leanlm.compress.quantize.llm_int8 import LLMInt8Config
from leanlm.compress.quantize.rtn import RTNConfig
from leanlm.compress.recipe import compress
from leanlm.compress.transform.awq import AWQConfig
from leanlm.compress.transform.gqa import GQAConfig
from leanlm.compress.transform.lkd import LKDConfig
from leanlm.compress.transform.moefy import MoefyConfig
from leanlm.compress.transform.smoothquant import SmoothQuantConfig
from leanlm.compress.transform.upcycle import UpcycleConfig

__all__ = [
    "compress",
    "calibration_samples",
    "read_calibration_text",
    "RTNConfig",
    "GPTQConfig",
    "AWQConfig",
    "SmoothQuantConfig",
    "LLMInt8Config",
    "FP8Config",
    "MagnitudeConfig",
    "PermuteConfig",
    "WandaConfig",
    "SparseGPTConfig",
    "ActivationSparsityConfig",
    "GQAConfig",
    "LKDConfig",
    "UpcycleConfig",
    "MoefyConfig",
    "CompressionReport",
    "LinearReport",
]
