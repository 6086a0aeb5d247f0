"""What sparse checkpoints load into: runtime layers for weights pruned to a pattern the kernels exploit
(`semi_structured.py`: 2:4, registered in QUANT_LINEAR_FORMATS as "sparse24"), and layers that skip the weights
of zeroed inputs (`activation.py`, "act_sparse"), unstructured sparse weights (`bitmask.py`, "sparse_bitmask",
compressed-tensors' sparse-bitmask layout). The methods that produce them live in leanlm.compress."""

# Importing the module registers its format before any checkpoint is read.
from leanlm.model.sparse import activation, bitmask, semi_structured  # noqa: F401
