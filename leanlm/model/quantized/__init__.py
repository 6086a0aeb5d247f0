"""What quantized checkpoints load into: the runtime quantized linears (`linear.py`, one class per saved format,
`QUANT_LINEAR_FORMATS`) and the quantization numerics they and the compression methods share (`numerics.py`).
The methods that produce them live in leanlm.compress."""
