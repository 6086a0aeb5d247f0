"""Runtime weight formats, one module each, and what they share: `base.py` (`RuntimeLinear`, the `LINEAR_FORMATS`
registry a checkpoint's saved `format` is looked up in), `dispatch.py` (the one kernel dispatcher), `checks.py`
(saved tensors' checks), `shard.py` (column / row-parallel slices) and `stack.py` (E experts for a grouped GEMM).
Formats: int8.py, int_group.py (2-4 bit), w8a8.py, fp8.py, llm_int8.py, sparse24.py (2:4), sparse24_quant.py
(2:4 with int8 / 4-bit codes), bitmask.py (unstructured), act_sparse.py (TEAL); the dense bf16 layer is
leanlm.model.layers.Linear. The methods that produce them live in leanlm.compress."""

# The registry lines: importing a format's module registers it before any checkpoint is read.
from leanlm.model.linear import act_sparse, bitmask, fp8, int8, int_group, llm_int8, sparse24, sparse24_quant, w8a8  # noqa: F401  # noqa: F401
