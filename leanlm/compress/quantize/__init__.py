"""Quantizers: methods that turn float linears into integer or fp8 runtime layers (RTN, GPTQ, LLM.int8(), FP8), the
integer schemes they share and the Method shape every quantizer has (linear_quantizer.py)."""
