"""How MoEfication (Zhang et al. 2022) cuts one FFN's intermediate neurons into E equal experts: balanced k-means
over a vector per neuron, either its weights (the paper's parameter clustering) or its activation pattern on
calibration tokens (standing in for the paper's co-activation graph partition, done there with METIS)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

SPLITS = ("weight", "coactivation")


def balanced_assign(cost: torch.Tensor, size: int) -> torch.Tensor:
    """labels [N] for cost [N, E] (N = size * E) with every cluster given exactly `size` points: points choose in
    order of how much they lose by missing their cheapest cluster (largest regret first), each taking its cheapest
    cluster with room left. A greedy stand-in for the min-cost assignment (Malinen & Fraenti's balanced k-means)."""
    c = cost.double().cpu().numpy()
    num_points, num_clusters = c.shape
    if num_points != size * num_clusters:
        raise ValueError(f"{num_points} points do not split into {num_clusters} clusters of {size}")
    ranked = np.sort(c, axis=1)
    regret = ranked[:, 1] - ranked[:, 0] if num_clusters > 1 else np.zeros(num_points)
    room = np.full(num_clusters, size)
    labels = np.empty(num_points, dtype=np.int64)
    for i in np.argsort(-regret, kind="stable"):
        row = np.where(room > 0, c[i], np.inf)
        e = int(row.argmin())
        labels[i] = e
        room[e] -= 1
    return torch.from_numpy(labels)


def balanced_kmeans(points: torch.Tensor, num_clusters: int, iters: int = 15, seed: int = 0) -> torch.Tensor:
    """labels [N] in [0, E): k-means on points [N, d] (squared Euclidean; unit-norm points make it cosine) with
    every cluster holding exactly N / E points. Centroids start at E distinct points (seeded); each round
    reassigns under the size constraint and moves centroids to their clusters' means, until nothing moves."""
    num_points = points.shape[0]
    if num_points % num_clusters:
        raise ValueError(f"{num_points} points do not split into {num_clusters} equal clusters")
    x = points.double()
    gen = torch.Generator().manual_seed(seed)
    centroids = x[torch.randperm(num_points, generator=gen)[:num_clusters]]  # [E, d]
    labels = None
    for _ in range(iters):
        new = balanced_assign(torch.cdist(x, centroids).pow(2), num_points // num_clusters)
        if labels is not None and torch.equal(new, labels):
            break
        labels = new
        one_hot = F.one_hot(labels, num_clusters).double()  # [N, E]
        centroids = (one_hot.T @ x) / one_hot.sum(0)[:, None]
    return labels


def intermediate(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's intermediate activations silu(x G^T) * (x U^T) [n, I] for inputs x [n, hidden], in float64."""
    x = x.double()
    return F.silu(x @ gate.double().T) * (x @ up.double().T)


def split_vectors(split: str, gate: torch.Tensor, acts: torch.Tensor | None) -> torch.Tensor:
    """One unit vector per neuron [I, d] to cluster: its gate_proj row (weight: the row that decides whether the
    neuron fires, W1's column in the paper), or |its activation| over the calibration tokens (coactivation:
    neurons that are large on the same tokens point the same way)."""
    if split == "weight":
        return F.normalize(gate.double(), dim=1)
    if acts is None:
        raise ValueError("the coactivation split clusters neurons by their calibration activations: pass calibration")
    return F.normalize(acts.abs().T, dim=1)  # [I, n]


def split_neurons(
    split: str, num_experts: int, gate: torch.Tensor, acts: torch.Tensor | None, iters: int, seed: int
) -> list[torch.Tensor]:
    """Each expert's neuron indices, ascending (E tensors of I / E longs) for gate weight [I, hidden] and the
    calibration activations acts [n, I] (coactivation only)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    labels = balanced_kmeans(split_vectors(split, gate, acts), num_experts, iters, seed)
    return [torch.nonzero(labels == e).flatten() for e in range(num_experts)]
