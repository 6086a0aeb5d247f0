"""Compression: one API for every method (torchao style), quantization and pruning, run through one
layer-by-layer loop."""

from leanlm.compress.act_sparsity import ActivationSparsityConfig
from leanlm.compress.awq import AWQConfig
from leanlm.compress.base import CompressionReport, LinearReport
from leanlm.compress.calibration import calibration_samples, read_calibration_text
from leanlm.compress.fp8 import FP8Config
from leanlm.compress.gptq import GPTQConfig
from leanlm.compress.gqa import GQAConfig
from leanlm.compress.lkd import LKDConfig
from leanlm.compress.llm_int8 import LLMInt8Config
from leanlm.compress.magnitude import MagnitudeConfig
from leanlm.compress.permute import PermuteConfig
from leanlm.compress.recipe import compress
from leanlm.compress.rtn import RTNConfig
from leanlm.compress.smoothquant import SmoothQuantConfig
from leanlm.compress.sparsegpt import SparseGPTConfig
from leanlm.compress.wanda import WandaConfig

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
    "CompressionReport",
    "LinearReport",
]
