"""Model similarity: cheap sketches, linear CKA, clustering into communities, similarity-biased peers.

A sketch is a fixed sparse random projection (a CountSketch, Clarkson and Woodruff 2013: each
coordinate is added with a random sign to one of ``dim`` buckets) of a worker's change since
the common start, ``(w - w0)``. It is built once per run from the seed and never trained.
Inner products of sketches are unbiased estimates of the changes' inner products, and
the cost is one pass over the parameters (``W * P`` adds), not a ``P x dim`` matrix.
The cosine of two sketches is the similarity: identical models have similarity 1
(also when neither has moved).
"""

from __future__ import annotations

import numpy as np
import torch

from . import schedule as schedule_mod

TAG_SKETCH, TAG_PROBE = schedule_mod.STREAMS["sketch"], schedule_mod.STREAMS["probe"]
SKETCH_DIM = 1024
PROBE_SIZE = 256
PEER_SHARPNESS = 2.0  # similarity_bias 1 weighs a peer one standard deviation more similar by e^2


class Sketcher:
    """The run's fixed projection: a bucket and a sign per parameter (the same for the same seed)."""

    def __init__(self, offsets: list[tuple[int, int]], start_row: torch.Tensor, seed: int, dim: int = SKETCH_DIM):
        n = sum(k for _, k in offsets)
        g = torch.Generator().manual_seed(int(schedule_mod.rng_for(seed, TAG_SKETCH).integers(2**62)))
        bucket = torch.randint(0, dim, (n,), generator=g)
        sign = torch.randint(0, 2, (n,), generator=g).float().mul_(2).sub_(1)
        dev = start_row.device
        self.dim = dim
        self.bucket = bucket.to(dev)
        self.sign = sign.to(dev)
        self.parts = [(self.bucket[o:o + k], self.sign[o:o + k], start_row[o:o + k].clone()) for o, k in offsets]

    def __call__(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        """Sketches ``[W, dim]`` of stacked parameters given as blocks ``[W, n_k]`` (a Stack's blocks)."""
        out = torch.zeros(blocks[0].shape[0], self.dim, device=blocks[0].device)
        for b, (bucket, sign, start) in zip(blocks, self.parts):
            out.index_add_(1, bucket, (b - start) * sign)
        return out


def cosine_matrix(s: torch.Tensor) -> torch.Tensor:
    """``[W, W]`` cosine similarities of rows; two zero rows are identical (1), a zero and a non-zero row 0."""
    norms = s.norm(dim=1)
    zero = norms == 0
    unit = s / torch.where(zero, torch.ones_like(norms), norms).unsqueeze(1)
    m = (unit @ unit.T).clamp_(-1.0, 1.0)
    m[zero[:, None] & zero[None, :]] = 1.0
    m.fill_diagonal_(1.0)
    return m


def linear_cka(acts: torch.Tensor) -> torch.Tensor:
    """``[W, W]`` linear CKA (Kornblith et al. 2019) of activations ``[W, n, f]`` on the same ``n`` inputs:
    the cosine of the workers' centred Gram matrices."""
    x = acts - acts.mean(1, keepdim=True)
    return cosine_matrix((x @ x.transpose(1, 2)).flatten(1))


def wire_bytes(kind: str, n_outputs: int) -> int:
    """What one worker sends so that another can take its similarity to the others: its sketch (float32), or for CKA
    its logits on the probe batch."""
    return 4 * SKETCH_DIM if kind == "sketch" else 4 * PROBE_SIZE * n_outputs


def probe_positions(n_train: int, seed: int, size: int = PROBE_SIZE) -> np.ndarray:
    """A fixed probe batch of training positions for CKA (drawn from the seed)."""
    return np.sort(schedule_mod.rng_for(seed, TAG_PROBE).choice(n_train, size=min(size, n_train), replace=False))


def summary(m: torch.Tensor) -> tuple[float, float]:
    """Mean and minimum over distinct pairs (1, 1 for a single worker)."""
    w = m.shape[0]
    if w < 2:
        return 1.0, 1.0
    iu = torch.triu_indices(w, w, 1)
    vals = m[iu[0], iu[1]]
    return float(vals.mean()), float(vals.min())


def cluster(m: torch.Tensor, k: int) -> np.ndarray:
    """Group the workers into at most ``k`` communities by agglomerative clustering (SciPy,
    average linkage) on the distance ``1 - similarity``. Labels are 0.. in order of each
    group's first worker, so equal groupings give equal labels."""
    from scipy.cluster.hierarchy import fcluster, linkage
    from scipy.spatial.distance import squareform

    w = m.shape[0]
    if w < 2 or k < 2:
        return np.zeros(w, dtype=np.int64)
    d = (1.0 - m.double().cpu().numpy()).clip(min=0.0)
    d = (d + d.T) / 2
    np.fill_diagonal(d, 0.0)
    raw = fcluster(linkage(squareform(d, checks=False), method="average"), t=min(k, w), criterion="maxclust")
    order = {lab: i for i, lab in enumerate(dict.fromkeys(raw.tolist()))}
    return np.array([order[lab] for lab in raw.tolist()], dtype=np.int64)


def biased_peer_probabilities(p: np.ndarray, sim: np.ndarray, bias: float) -> np.ndarray:
    """Reweigh one initiator's peer distribution ``p`` by similarity to each candidate.

    Similarities of the candidates (``p > 0``) are standardised, so the bias means the same
    whether the models are all alike or not: weight ``p_j * exp(PEER_SHARPNESS * bias * z_j)``.
    """
    cand = p > 0
    if bias == 0 or cand.sum() < 2:
        return p
    s = sim[cand]
    sd = s.std()
    z = np.zeros_like(s) if sd < 1e-12 else (s - s.mean()) / sd
    out = np.zeros_like(p)
    out[cand] = p[cand] * np.exp(PEER_SHARPNESS * bias * z)
    return out / out.sum()


def draw(p: np.ndarray, u: float) -> int:
    """Inverse-CDF draw of one index from ``p`` with the uniform ``u``."""
    return int(min(np.searchsorted(np.cumsum(p), u, side="right"), len(p) - 1))
