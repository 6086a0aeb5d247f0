"""What quantized checkpoints load into: the runtime quantized linears (`linear.py`, one class per saved format,
`QUANT_LINEAR_FORMATS`) and the quantization numerics they and the compression methods share (`numerics.py`).
The methods that produce them live in leanlm.compress."""

# Importing every format's module registers it in QUANT_LINEAR_FORMATS before any checkpoint is read.
from leanlm.model.quantized import fp8, linear, llm_int8, w8a8  # noqa: E402, F401
