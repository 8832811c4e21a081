"""Merge operators: pure functions on tensors.

No process groups, no topology, no schedule: how much each side moves, the weight on an
incoming model from the supports, averages, deltas and their compression. What a merge
does to the receiving rows is :mod:`evomerge.engine.kernel`, which every path calls.
Random choices take an explicit ``torch.Generator``.
"""

from __future__ import annotations

import math

import torch


# -- mixing weights -------------------------------------------------------------
def scheduled_weight(start: float, final: float, kind: str, progress: float) -> float:
    """Mixing weight at ``progress`` in [0, 1] of the run: constant, linear or cosine from start to final."""
    progress = min(max(progress, 0.0), 1.0)
    if kind == "constant":
        return start
    if kind == "linear":
        return start + (final - start) * progress
    if kind == "cosine":
        return final + (start - final) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"mixing_schedule: unknown {kind!r}; allowed: constant, linear, cosine")


def pair_moves(a: float, u: float, winner_bias: float, random_lerp: bool, winner: int | None) -> tuple[float, float]:
    """How far (initiator, peer) each move towards the other in one merge event.

    ``m = u * a`` for a random lerp, ``a`` otherwise. The loser moves ``m``, the winner
    ``(1 - winner_bias) * m``; ``winner`` is 0 (initiator), 1 (peer) or None (no comparison).
    """
    m = a * u if random_lerp else a
    moves = [m, m]
    if winner is not None:
        moves[winner] = m * (1.0 - winner_bias)
    return moves[0], moves[1]


def counts(examples: torch.Tensor):
    """The example counters to read and update one by one: on the host (where they live, but for the runtime on a
    GPU) as a numpy view of their memory, so that reading or adding is no tensor operation."""
    return examples.numpy() if examples.device.type == "cpu" else examples


def incoming_weight(a, support_own=None, support_in=None):
    """Weight on the incoming model for a receiver that moves ``a`` towards it.

    With supports (examples seen, or per-coordinate accumulators) the two sides are
    weighted ``(1 - a) * s_own`` and ``a * s_in``, normalised; ``a = 1/2`` gives the
    weighted average by support, equal supports give plain ``a``. Zero supports on
    both sides fall back to ``a``.
    """
    if support_own is None:
        return a
    num = a * support_in
    den = num + (1.0 - a) * support_own
    if isinstance(den, torch.Tensor):
        return torch.where(den > 0, num / den.clamp_min(torch.finfo(den.dtype).tiny), torch.full_like(den, a))
    return num / den if den > 0 else a


def weighted_average(params: torch.Tensor, support: torch.Tensor | None = None,
                     dim: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Average ``params`` ``[k, ...]`` weighted by ``support`` (``[k]`` counts or ``[k, ...]`` per coordinate).

    Returns the average and the merged support: counters are summed, not averaged
    (VW's merge). Without support it is the plain mean. ``dim``: the dimension of the ``k`` models, for several
    groups of them at once (``[g, k, ...]`` with ``support`` ``[g, k]``, ``dim=1``: a population's members).
    """
    if support is None:
        return params.mean(dim), None
    s = support.to(device=params.device, dtype=params.dtype)  # example counters live on the host
    while s.dim() < params.dim():
        s = s.unsqueeze(-1)
    return average_from_sums((s * params).sum(dim), s.sum(dim), params.mean(dim)), support.sum(dim)


def average_from_sums(num: torch.Tensor, total: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """``num / total`` where the summed support ``total`` is positive, ``fallback`` (the plain mean) elsewhere:
    the last step of :func:`weighted_average`, for callers that sum across processes first."""
    safe = torch.where(total > 0, total, torch.ones_like(total))
    return torch.where(total > 0, num / safe, fallback)


def consensus(params: torch.Tensor) -> torch.Tensor:
    """The consensus model: the mean over the leading worker dimension."""
    return params.mean(0)


def consensus_distance(params: torch.Tensor, center: torch.Tensor | None = None) -> float:
    """Mean over workers of the squared L2 distance to the consensus model."""
    center = consensus(params) if center is None else center
    return float((params - center).pow(2).sum(dim=tuple(range(1, params.dim()))).mean())


# -- deltas (VW's model_delta) ----------------------------------------------------
def delta(current: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """``current - base``: what changed since the last synchronised state."""
    return current - base


def apply_delta(base: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``base + delta``: the model the delta describes."""
    return base + d


# -- compression ------------------------------------------------------------------
def topk_mask_count(n: int, fraction: float) -> int:
    return max(1, min(n, int(math.ceil(fraction * n))))


def topk_with_feedback(x: torch.Tensor, residual: torch.Tensor | None, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k sparsification with error feedback.

    ``v = x + residual``; the ``ceil(fraction * n)`` largest-magnitude entries of ``v``
    are sent (returned dense, zeros elsewhere); the rest is the new residual, so
    ``sent + new_residual == x + residual`` exactly: nothing is lost for good.
    """
    v = x if residual is None else x + residual
    flat = v.reshape(-1)
    k = topk_mask_count(flat.numel(), fraction)
    sent = torch.zeros_like(flat)
    if k >= flat.numel():
        sent.copy_(flat)
    else:
        idx = flat.abs().topk(k, sorted=False).indices
        sent[idx] = flat[idx]
    sent = sent.view_as(v)
    return sent, v - sent


def quantize_stochastic(x: torch.Tensor, bits: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Unbiased stochastic rounding to ``2**(bits-1) - 1`` magnitude levels of ``max|x|`` (QSGD).

    Returns the dequantised tensor; ``E[result] == x``. Noise comes from ``generator``
    (on the CPU, so every backend draws the same numbers).
    """
    if bits < 2:
        raise ValueError(f"bits: {bits} is out of range; allowed: 2..16")
    levels = 2 ** (bits - 1) - 1
    scale = x.abs().max()
    if scale == 0 or not torch.isfinite(scale):
        return x.clone()
    y = x.abs() / scale * levels
    noise = torch.rand(x.shape, generator=generator, dtype=x.dtype).to(x.device)
    q = torch.floor(y + noise).clamp_(max=levels)
    return torch.sign(x) * q * (scale / levels)


def compress(x: torch.Tensor, fraction: float, bits: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """What goes on the wire for ``x``: its top-k entries, stochastically quantised when ``bits`` > 1, as scaled
    signs when ``bits`` is 1.

    Returned dense (zeros where nothing was sent); the caller keeps ``x - compress(x)`` as
    error feedback. It is ``decode(encode(x))``: the in-process backend and the distributed
    one, which sends the encoded parts, reconstruct the same numbers.
    """
    return decode(encode(x, fraction, bits, generator), x.numel(), fraction, bits).view_as(x)


def wire_spec(n: int, fraction: float, bits: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of the tensors :func:`encode` puts on the wire for ``n`` values."""
    k = n if fraction >= 1.0 else topk_mask_count(n, fraction)
    spec: list[tuple[tuple[int, ...], torch.dtype]] = []
    if k < n:
        spec.append(((k,), torch.int32))  # positions
    if bits:
        spec += [((k,), torch.int8 if bits <= 8 else torch.int16), ((1,), torch.float32)]  # signed levels, scale
    else:
        spec.append(((k,), torch.float32))
    return spec


def encode(x: torch.Tensor, fraction: float, bits: int, generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """The compact form of ``compress(x)``: [positions] (top-k only), then float32 values or
    signed integer levels and their float32 scale (QSGD, see :func:`quantize_stochastic`; with 1 bit the signs and
    their mean magnitude, EF-signSGD's scaled sign, which draws no noise). The signs travel as int8 here, and are
    charged as 1 bit each (:func:`payload_bytes`), as a packed wire would send them."""
    flat = x.reshape(-1)
    n = flat.numel()
    k = n if fraction >= 1.0 else topk_mask_count(n, fraction)
    parts: list[torch.Tensor] = []
    if k < n:
        idx = flat.abs().topk(k, sorted=False).indices
        parts.append(idx.to(torch.int32))
        values = flat[idx]
    else:
        idx, values = None, flat
    if not bits:
        return parts + [values.clone()]
    if bits == 1:  # scaled sign (EF-signSGD, Karimireddy et al. 2019): sign(v) ||v||_1 / k, no noise
        scale = values.abs().mean()
        scale = scale if torch.isfinite(scale) else torch.zeros_like(scale)
        return parts + [torch.sign(values).to(torch.int8), scale.reshape(1).to(torch.float32)]
    if bits < 1:
        raise ValueError(f"bits: {bits} is out of range; allowed: 1..16")
    levels = 2 ** (bits - 1) - 1
    # the noise is drawn for all n coordinates, as quantize_stochastic does on the dense tensor
    noise = torch.rand(n, generator=generator, dtype=flat.dtype).to(flat.device)
    noise = noise if idx is None else noise[idx]
    scale = values.abs().max()
    if scale == 0 or not torch.isfinite(scale):
        q = torch.zeros_like(values)
    else:
        q = torch.sign(values) * torch.floor(values.abs() / scale * levels + noise).clamp_(max=levels)
    return parts + [q.to(torch.int8 if bits <= 8 else torch.int16), scale.reshape(1).to(torch.float32)]


def decode(parts: list[torch.Tensor], n: int, fraction: float, bits: int) -> torch.Tensor:
    """The dense ``[n]`` float32 tensor that :func:`encode`'s parts describe."""
    k = n if fraction >= 1.0 else topk_mask_count(n, fraction)
    parts = list(parts)
    idx = parts.pop(0).long() if k < n else None
    if bits:
        q, scale = parts
        levels = 2 ** (bits - 1) - 1 if bits > 1 else 1  # 1 bit: the scale is the magnitude itself
        values = q.to(torch.float32) * (scale[0] / levels)
    else:
        values = parts[0]
    if idx is None:
        return values.clone()
    out = torch.zeros(n, dtype=values.dtype, device=values.device)
    out[idx] = values
    return out


def payload_bytes(n: int, fraction: float = 1.0, bits: int = 0) -> int:
    """Bytes on the wire for ``n`` float32 values sent as top-``fraction`` with ``bits``-bit values.

    Sparse payloads pay for positions too: 4 bytes each or an ``n``-bit mask, whichever is
    smaller. Quantised payloads add one float32 scale.
    """
    k = n if fraction >= 1.0 else topk_mask_count(n, fraction)
    value_bits = bits if bits else 32
    size = math.ceil(k * value_bits / 8)
    if k < n:
        size += min(4 * k, math.ceil(n / 8))
    if bits:
        size += 4
    return size
