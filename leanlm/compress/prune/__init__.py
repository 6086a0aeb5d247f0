"""Pruners: methods that zero weights (magnitude, Wanda, SparseGPT) with their shared targets and Method shape
(sparsity.py, pruner.py), OWL's per-layer sparsity plan and the channel permutation that helps N:M patterns."""
