"""What sparse checkpoints load into: runtime layers for weights pruned to a pattern the kernels exploit
(`semi_structured.py`: 2:4, registered in QUANT_LINEAR_FORMATS as "sparse24"; `quantized_24.py`: 2:4 with int8 or
2-4 bit kept weights, "sparse24_int8" and "sparse24_int4"; `bitmask.py`: unstructured sparse weights,
"sparse_bitmask", compressed-tensors' sparse-bitmask layout), and layers that skip the weights of zeroed inputs
(`activation.py`, "act_sparse"). The methods that produce them live in leanlm.compress."""

# Importing the module registers its format before any checkpoint is read.
from leanlm.model.sparse import activation, bitmask, quantized_24, semi_structured  # noqa: F401
