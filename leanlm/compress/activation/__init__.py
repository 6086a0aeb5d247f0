"""Activation sparsity: methods that zero a linear's small inputs at run time (TEAL thresholds and their per-layer
allocation); the weights stay as they are."""
