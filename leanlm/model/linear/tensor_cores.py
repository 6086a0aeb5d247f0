"""2:4 weights on NVIDIA's sparse tensor cores (compute capability 8.0+), through PyTorch's semi-structured sparse
tensors: cuSPARSELt where PyTorch has it, CUTLASS otherwise. Sparse24Linear runs a CUDA product here only when it is
large enough to pay for the semi-structured call's fixed cost; smaller ones stay on cuBLAS with the widened weight
(`benchmarks/gpu_sparse24.py`, the table in docs/sparsity.md)."""

from __future__ import annotations

import warnings

import torch

# Multiply-adds (rows x N x K) from which a product takes the sparse tensor cores. Measured on an H200 with torch
# 2.11's cuSPARSELt path: each eager call costs about 0.45 ms whatever its size, so only products of about 1e12
# multiply-adds (a Llama-3-8B gate/up/down at 16k rows: that layer 1.29x) beat cuBLAS on the dense weight; every
# SmolLM2 and Qwen2.5 shape up to 16k rows ran 2-30x slower there.
MIN_MACS = 10**12
_DTYPES = (torch.float16, torch.bfloat16)
# The stricter backend's shape rule (CUTLASS: weight rows % 32, columns % 64); cuSPARSELt's is looser.
_ROW_MULTIPLE, _COL_MULTIPLE = 32, 64


def is_available(device: torch.device) -> bool:
    """A CUDA device with sparse tensor cores and a PyTorch that drives them there: cuSPARSELt, or CUTLASS, whose
    PyTorch kernels run on compute capability 8.x only (not Hopper)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 0):
        return False
    return torch.backends.cusparselt.is_available() or torch.cuda.get_device_capability(device)[0] == 8


def fits(values: torch.Tensor) -> bool:
    """Whether the kernels take the 2:4 weight [N, K] whose kept values [N, K / 2] these are."""
    n, half_k = values.shape
    return values.dtype in _DTYPES and n % _ROW_MULTIPLE == 0 and (2 * half_k) % _COL_MULTIPLE == 0


def should_use(x: torch.Tensor, values: torch.Tensor) -> bool:
    """A product of MIN_MACS+ multiply-adds over x in values' dtype on a CUDA device with sparse tensor cores, and a
    weight that fits."""
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    return (
        x.is_cuda
        and values.is_cuda
        and rows * values.shape[0] * 2 * values.shape[1] >= MIN_MACS
        and x.dtype is values.dtype
        and fits(values)
        and is_available(x.device)
    )


def backend() -> type:
    """cuSPARSELt's tensor class where PyTorch was built with it, else CUTLASS's (see is_available)."""
    if torch.backends.cusparselt.is_available():
        return torch.sparse.SparseSemiStructuredTensorCUSPARSELT
    return torch.sparse.SparseSemiStructuredTensorCUTLASS


def compress(dense: torch.Tensor, tensor_class: type | None = None) -> torch.Tensor:
    """The 2:4 weight [N, K] (at most 2 nonzeros in every 4 columns: not checked here) as a semi-structured
    tensor that F.linear multiplies on the sparse tensor cores."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch warns once that the API is a prototype
        return (tensor_class or backend()).from_dense(dense.contiguous())
