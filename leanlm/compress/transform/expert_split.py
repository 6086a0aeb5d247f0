"""How MoEfication (Zhang et al. 2022) cuts one FFN's intermediate neurons into E equal experts: balanced k-means
over a vector per neuron, either its weights (the paper's parameter clustering) or its activation pattern on
calibration tokens (standing in for the paper's co-activation graph partition, done there with METIS)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

SPLITS = ("weight", "coactivation")
# A SwiGLU neuron is never exactly zero, so "activated" (ReLU's > 0 in the paper) means: among the largest 10% of
# |activations| of its token. Clustering these firing patterns kept 1-5 points more of the activation mass in the
# top-25% experts on SmolLM2's held-out calibration tokens than clustering the |activations| themselves.
FIRING_SHARE = 0.1


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
    every cluster holding exactly N / E points. Centroids start at k-means++ picks (seeded); each round
    reassigns under the size constraint and moves centroids to their clusters' means, until nothing moves."""
    num_points = points.shape[0]
    if num_points % num_clusters:
        raise ValueError(f"{num_points} points do not split into {num_clusters} equal clusters")
    x = points.double()
    centroids = kmeans_pp(x, num_clusters, torch.Generator().manual_seed(seed))  # [E, d]
    labels = None
    for _ in range(iters):
        new = balanced_assign(torch.cdist(x, centroids).pow(2), num_points // num_clusters)
        if labels is not None and torch.equal(new, labels):
            break
        labels = new
        one_hot = F.one_hot(labels, num_clusters).double()  # [N, E]
        centroids = (one_hot.T @ x) / one_hot.sum(0)[:, None]
    return labels


def kmeans_pp(x: torch.Tensor, num_clusters: int, gen: torch.Generator) -> torch.Tensor:
    """k-means++ seeding (Arthur & Vassilvitskii 2007): each next centroid a point drawn with probability
    proportional to its squared distance from the nearest centroid so far -> [E, d]."""
    picks = [int(torch.randint(x.shape[0], (1,), generator=gen))]
    nearest = (x - x[picks[0]]).pow(2).sum(1)  # [N]
    for _ in range(num_clusters - 1):
        weights = nearest if float(nearest.sum()) > 0 else torch.ones_like(nearest)
        picks.append(int(torch.multinomial(weights, 1, generator=gen)))
        nearest = torch.minimum(nearest, (x - x[picks[-1]]).pow(2).sum(1))
    return x[picks].clone()


def intermediate(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's intermediate activations silu(x G^T) * (x U^T) [n, I] for inputs x [n, hidden], in float64."""
    x = x.double()
    return F.silu(x @ gate.double().T) * (x @ up.double().T)


def split_vectors(split: str, gate: torch.Tensor, acts: torch.Tensor | None) -> torch.Tensor:
    """One unit vector per neuron [I, d] to cluster: its gate_proj row (weight: the row that decides whether the
    neuron fires, W1's column in the paper), or whether it fires on each calibration token (coactivation: the
    cosine of two neurons' vectors is their co-firing count over the geometric mean of their firing counts, so
    k-means gathers the neurons that fire together, the paper's co-activation graph, partitioned by METIS there)."""
    if split == "weight":
        return F.normalize(gate.double(), dim=1)
    if acts is None:
        raise ValueError("the coactivation split clusters neurons by their calibration activations: pass calibration")
    mag = acts.abs()
    cut = mag.quantile(1 - FIRING_SHARE, dim=1, keepdim=True)  # [n, 1]: each token's top-10% line
    return F.normalize((mag >= cut).double().T, dim=1)  # [I, n]


def split_neurons(
    split: str, num_experts: int, gate: torch.Tensor, acts: torch.Tensor | None, iters: int, seed: int
) -> list[torch.Tensor]:
    """Each expert's neuron indices, ascending (E tensors of I / E longs) for gate weight [I, hidden] and the
    calibration activations acts [n, I] (coactivation only)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    labels = balanced_kmeans(split_vectors(split, gate, acts), num_experts, iters, seed)
    return [torch.nonzero(labels == e).flatten() for e in range(num_experts)]
