"""Transforms: methods that change float weights (and norms) so that later steps lose less or the model runs
cheaper, computing what it did (smoothing: SmoothQuant, AWQ) or close to it (GQA conversion; LKD, which distils
each already-quantized layer back towards its float output), or a cheaper model of the same weights (MoEfication:
the FFNs split into experts, a router running k of them per token); sparse upcycling makes a dense model a mixture
of experts that computes what it did."""
