"""Quantization math the runtime formats (leanlm.model.linear) and the compression methods share (`numerics.py`),
and the fake-quantized stand-ins quantization-aware training swaps in (`fake_quant.py`)."""
