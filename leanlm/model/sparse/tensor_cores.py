"""2:4 weights on NVIDIA's sparse tensor cores (compute capability 8.0+), through PyTorch's semi-structured sparse
tensors: cuSPARSELt where PyTorch has it, CUTLASS otherwise. Sparse24Linear runs its CUDA rows here when there are
enough of them; fewer rows stay on cuBLAS with the widened weight, which `benchmarks/gpu_sparse24.py` measured to
be faster there (the table in docs/sparsity.md)."""

from __future__ import annotations

import warnings

import torch

# Rows [M] at or above which the sparse product beats cuBLAS on the widened weight; measured on an H200 with
# SmolLM2 and Qwen2.5 shapes (benchmarks/gpu_sparse24.py).
MIN_ROWS = 256
_DTYPES = (torch.float16, torch.bfloat16)
# The stricter backend's shape rule (CUTLASS: weight rows % 32, columns % 64); cuSPARSELt's is looser.
_ROW_MULTIPLE, _COL_MULTIPLE = 32, 64


def is_available(device: torch.device) -> bool:
    """A CUDA device with sparse tensor cores and a PyTorch that drives them there: cuSPARSELt, or CUTLASS, whose
    PyTorch kernels run on compute capability 8.x only (not Hopper)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 0):
        return False
    return torch.backends.cusparselt.is_available() or torch.cuda.get_device_capability(device)[0] == 8


def fits(weight: torch.Tensor) -> bool:
    """A weight [N, K] (or its kept values [N, K / 2]: same N, and K / 2 % 32 == K % 64) the kernels take."""
    n, k = weight.shape
    return weight.dtype in _DTYPES and n % _ROW_MULTIPLE == 0 and (2 * k) % _COL_MULTIPLE == 0


def should_use(x: torch.Tensor, values: torch.Tensor) -> bool:
    """MIN_ROWS+ rows of x in values' dtype on a CUDA device with sparse tensor cores, and a weight that fits."""
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    return (
        x.is_cuda
        and values.is_cuda
        and rows >= MIN_ROWS
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
