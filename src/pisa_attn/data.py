"""Synthetic DiT-like q/k/v on image/video token grids (seeded, deterministic).

Random Gaussian q/k/v are not representative of DiT attention: their softmax is flat and no sparse
method is usable on them; use them for correctness tests only. This generator builds, per head, in
original (raster) token order:

* a **positional term**: a constant per-head vector ``a`` rotated by 3D (video) or 2D (image)
  RoPE, so ``q_t·k_s`` contains ``Σ_i |a_i|² cos(θ_i (p_t − p_s))``, a locality kernel of the
  displacement. Its spectrum over the RoPE frequencies of each axis is Gaussian-shaped (width
  ``σ`` tokens), so the kernel decays with distance. Head types set ``σ`` and the gain per axis
  (:data:`HEAD_KERNELS`); ``sharpness`` scales every positional logit;
* a **content term**: a smooth random field (random Fourier features) shared by q, k and v
  through per-head projections, k's correlated with q's so that similar content attracts
  attention. Its correlation length per axis depends on the head type (:data:`HEAD_CONTENT`):
  *spatial* heads see features that change from frame to frame but are smooth within a frame
  (they attend within their frame), *temporal* heads features that persist over time but change
  quickly in space (they attend to the same place across frames), *mixed* heads a local 3D
  neighbourhood, *global* heads are flat-ish. The content sits in slowly rotating RoPE pairs, as
  semantic features do in trained models;
* a **detail term**: a fine-scale field that values carry strongly and keys weakly (texture);
  the within-block key/value covariance it creates is what PISA's first-order term recovers;
* **per-token noise**; optional **sink keys** (scored high by every query), **outlier key
  channels** (large, slowly varying offsets in a few channels of k), **text tokens** (no RoPE,
  iid content, a common key component giving them modest mass).

Default head-type proportions follow Sparse-VideoGen's measurements for video (~30% spatial,
~60-65% temporal, the rest mixed/global); images use spatial/mixed/global.

On these defaults the top 12.5 % of key blocks hold most of each head's attention mass, and the
errors order drop > zeroth ≳ hybrid ≳ first; the first-order gain over zeroth is small when
attention is peaked (second-order terms are then as large as the first-order one). Measured
numbers: ``notes/token-layouts.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from . import layout as lay
from . import spec
from .settings import as_float
from .spec import num_selected

HEAD_TYPES = ("spatial", "temporal", "mixed", "global")
# Per head type: positional (σ, gain) per axis (t, h, w): the positional logit of a key at
# displacement Δ is about sharpness · Σ_axis gain · K_σ(Δ_axis), K_σ(0) = 1. Wide kernels keep the
# scores smooth inside far blocks (as measured in DiTs: the tail is flat). Images use (h, w).
HEAD_KERNELS = {
    "spatial": ((4.0, 1.0), (12.0, 0.5), (12.0, 0.5)),
    "temporal": ((24.0, 0.2), (4.0, 1.0), (4.0, 1.0)),
    "mixed": ((4.0, 0.7), (6.0, 0.7), (6.0, 0.7)),
    "global": ((24.0, 0.15), (24.0, 0.15), (24.0, 0.15)),
}
# Per head type: content correlation length per axis (t, h, w) in units of ``smoothness``.
HEAD_CONTENT = {
    "spatial": (0.5, 1.5, 1.5),
    "temporal": (3.0, 0.5, 0.5),
    "mixed": (1.0, 1.0, 1.0),
    "global": (3.0, 3.0, 3.0),
}
HEAD_MIX = {  # percent of heads per type (listed first wins ties when rounding)
    3: {"spatial": 30, "temporal": 60, "mixed": 5, "global": 5},
    2: {"spatial": 60, "mixed": 30, "global": 10},
}
LAYOUTS = ("bhsd", "bshd")
_F = torch.float32  # generation dtype (float32 keeps the 118k-token grids within a few GB)
_RHO = 0.8  # correlation of the q and k projections of a field
_Q_BIAS = 2.0  # norm of the common query direction that sinks and text keys align with
_FEATURES = 128  # random Fourier features per smooth field


@dataclass(frozen=True)
class _Params:
    sharpness: float
    content: float
    smoothness: float
    content_band: float
    content_rank: int
    detail: float
    detail_length: float
    detail_value: float
    noise: float
    diagonal: float
    sink_keys: int
    sink_strength: float
    outlier_channels: int
    outlier_scale: float
    text_strength: float
    rope_theta: float


@dataclass
class DitQKV:
    """Generated attention inputs.

    q, k, v: ``[B, H, L, D]`` (``layout="bhsd"``) or ``[B, L, H, D]``, tokens in the order of
        ``token_layout`` (tiled for ``tiled=True``, original order otherwise).
    token_layout: the :class:`~pisa_attn.layout.TokenOrder` the token order follows.
    head_types: one of :data:`HEAD_TYPES` per head.
    sink_index: original-order indices of the sink keys (empty when none).
    """

    q: Tensor
    k: Tensor
    v: Tensor
    token_layout: lay.TokenOrder
    head_types: list[str]
    layout: str
    sink_index: Tensor

    def keep_blocks(self, block_size: int = 64) -> Tensor | None:
        """Bool [Nk]: key blocks holding text or sink keys (for ``pisa_attention(keep_blocks=...)``),
        or None when there are neither."""
        lay._check_int("block_size", block_size, 1)
        if self.token_layout.num_text_tokens == 0 and self.sink_index.numel() == 0:
            return None
        keep = self.token_layout.keep_blocks(block_size).clone()
        keep[self.token_layout.inv_perm[self.sink_index] // block_size] = True
        return keep


def default_head_types(heads: int, rank: int = 3) -> list[str]:
    """Head types in the default proportions (largest-remainder rounding), grouped by type."""
    mix = HEAD_MIX[rank]
    counts = {t: heads * pct // 100 for t, pct in mix.items()}  # integers: exact remainders
    for t in sorted(mix, key=lambda t: -(heads * mix[t] % 100))[: heads - sum(counts.values())]:
        counts[t] += 1
    return [t for t in mix for _ in range(counts[t])]


def rope_frequencies(pairs: int, theta: float) -> Tensor:
    """Standard RoPE frequencies ``θ_i = theta^(-i / pairs)`` of one axis (float64)."""
    return theta ** (-torch.arange(pairs, dtype=torch.float64) / pairs)


def axis_pairs(head_dim: int, rank: int) -> list[int]:
    """Rotary pairs per axis: Wan's split for video (h and w get ``D // 6`` pairs each, t the
    rest), an even split for images."""
    pairs = head_dim // 2
    if rank == 2:
        return [pairs - pairs // 2, pairs // 2]
    hw = head_dim // 6
    return [pairs - 2 * hw, hw, hw]


def dit_qkv(
    grid,
    *,
    heads: int = 8,
    head_dim: int = 64,
    batch: int = 1,
    text_tokens: int = 0,
    text_position: str = "before",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    layout: str = "bhsd",
    tile=None,
    tiled: bool = True,
    head_types=None,
    sharpness: float = 3.0,
    content: float = 6.0,
    smoothness: float = 5.0,
    content_band: float = 8.0,
    content_rank: int = 64,
    detail: float = 1.0,
    detail_length: float = 1.5,
    detail_value: float = 2.0,
    noise: float = 0.1,
    diagonal: float = 0.0,
    sink_keys: int = 0,
    sink_strength: float = 4.0,
    outlier_channels: int = 0,
    outlier_scale: float = 8.0,
    text_strength: float = 2.0,
    rope_theta: float = 10000.0,
) -> DitQKV:
    """Seeded DiT-like ``q, k, v`` on a ``(t, h, w)`` video or ``(h, w)`` image token grid.

    Args:
        grid: ``(t, h, w)`` or ``(h, w)`` token grid (after patchify).
        heads, head_dim, batch: sizes (``head_dim`` even, at least ``2 * len(grid)``).
        text_tokens: text tokens placed ``text_position`` (``"before"``/``"after"``) the grid in
            original order (Flux puts text before the image, SD3/Hunyuan after).
        seed: all randomness comes from one CPU generator: the same seed gives the same tensors
            on any device and in either token order.
        dtype, device, layout: of the returned tensors (``"bhsd"`` or ``"bshd"``, contiguous).
        tile, tiled: ``tiled=True`` returns tokens in the compact tiled order of
            :func:`pisa_attn.layout.make_layout` (``tile`` defaults to 8x8 / 4x4x4), else in
            original order (``token_layout`` is then the raster layout).
        head_types: one of the rank's types per head (video: :data:`HEAD_TYPES`; images: no
            ``"temporal"``); default :func:`default_head_types`.
        sharpness: scale of the positional logits.
        content: q·k logit of identical content; higher is peakier attention.
        smoothness: content correlation length in tokens (times the head type's factors).
        content_band: content energy per rotary pair ∝ exp(-(θ·content_band)²/2).
        content_rank: channels of the content field (more: less random long-range matching).
        detail, detail_length, detail_value: fine field of correlation length ``detail_length``,
            logit gain ``detail`` in q/k, std ``detail_value`` in v.
        noise: independent per-token noise (relative std) on q, k and v.
        diagonal: logit boost of a token's own key (shared per-token feature in q and k).
        sink_keys, sink_strength: number of sink keys and their logit boost from every query.
        outlier_channels, outlier_scale: key channels offset by ``outlier_scale`` times k's std.
        text_strength: logit boost of the text keys' common component.
        rope_theta: RoPE base.
    """
    g = lay.Grid(lay._check_shape("grid", grid))
    rank = len(g.shape)
    # numpy ints are taken and read as Python ints from here on
    heads, batch, text_tokens, seed, content_rank, sink_keys, outlier_channels, head_dim = (
        lay._check_int(name, value, low)
        for name, value, low in (("heads", heads, 1), ("batch", batch, 1), ("text_tokens", text_tokens, 0),
                                 ("seed", seed, 0), ("content_rank", content_rank, 1), ("sink_keys", sink_keys, 0),
                                 ("outlier_channels", outlier_channels, 0), ("head_dim", head_dim, 2 * rank)))
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (rotary pairs), got {head_dim}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if text_position not in ("before", "after"):
        raise ValueError(f"text_position must be 'before' or 'after', got {text_position!r}")
    if dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"dtype must be float16, bfloat16, float32 or float64, got {dtype!r}")
    if sink_keys > g.num_tokens:
        raise ValueError(f"sink_keys ({sink_keys}) must not exceed the grid's {g.num_tokens} tokens")
    if outlier_channels > head_dim:
        raise ValueError(f"outlier_channels ({outlier_channels}) must not exceed head_dim ({head_dim})")
    if g.num_tokens * batch < 2 and (text_tokens or outlier_channels):
        # their scale is the image tokens' standard deviation, which one token does not have
        raise ValueError(f"text_tokens and outlier_channels need at least two image tokens (grid x batch), "
                         f"got {g.num_tokens * batch}")
    floats = dict(sharpness=sharpness, content=content, content_band=content_band, detail=detail,
                  detail_value=detail_value, noise=noise, diagonal=diagonal, sink_strength=sink_strength,
                  outlier_scale=outlier_scale, text_strength=text_strength)
    floats = {name: _check_float(name, value) for name, value in floats.items()}
    for name, value in (("smoothness", smoothness), ("detail_length", detail_length), ("rope_theta", rope_theta)):
        floats[name] = _check_float(name, value, strict=True)
    if floats["rope_theta"] <= 1.0:
        raise ValueError(f"rope_theta must be > 1, got {rope_theta}")
    p = _Params(content_rank=content_rank, sink_keys=sink_keys, outlier_channels=outlier_channels, **floats)
    types = _head_types(head_types, heads, rank)

    before, after = (text_tokens, 0) if text_position == "before" else (0, text_tokens)
    token_layout = (lay.make_layout(g.shape, tile=tile, text_before=before, text_after=after) if tiled
                    else lay.raster(g.shape, text_before=before, text_after=after))
    gen = torch.Generator().manual_seed(seed)
    coords = lay.raster(g.shape).coords().to(_F)  # [Lg, r], original order
    q, k, v, sinks, u = _grid_qkv(coords, types, head_dim, batch, gen, p)
    if text_tokens:
        qt, kt, vt = _text_qkv(q, u, text_tokens, gen, p)
        first, second = ((qt, kt, vt), (q, k, v)) if before else ((q, k, v), (qt, kt, vt))
        q, k, v = (torch.cat((a, b), dim=2) for a, b in zip(first, second))
        sinks = sinks + before
    out = []
    for x in (q, k, v):
        x = token_layout.to_tiled(x, dim=2)
        x = x if layout == "bhsd" else x.transpose(1, 2)
        out.append(x.to(device=device, dtype=dtype).contiguous())
    for name, x in zip("qkv", out):  # finite but extreme parameters (sharpness=1e300) overflow
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"these parameters give a non-finite {name} (overflow in {x.dtype}): "
                             + ", ".join(f"{k}={v:g}" for k, v in floats.items()))
    return DitQKV(*out, token_layout=token_layout, head_types=types, layout=layout, sink_index=sinks)


def describe(q: Tensor, k: Tensor, *, block_size: int = 64, density: float = 0.125, query_blocks: int = 16,
             seed: int = 0) -> dict[str, list[float]]:
    """Per-head attention statistics of ``[B, H, L, D]`` q/k on a sample of query blocks.

    ``tail_mass``: softmax mass outside each query block's best ``k`` key blocks (PISA's count:
    :func:`pisa_attn.spec.num_selected`, density · N rounded half up)
    (ranked by their true mass: the oracle tail); ``tail_block_std``: mass-weighted std of the
    scores inside those tail blocks (small means the tail is flat, where Taylor terms work).
    """
    spec.check_density(density)
    spec.check_block_size(block_size)
    if isinstance(query_blocks, bool) or not isinstance(query_blocks, int) or query_blocks < 1:
        raise ValueError(f"query_blocks must be a positive int, got {query_blocks!r}")
    if q.dim() != 4 or k.dim() != 4 or k.shape[0] != q.shape[0] or k.shape[1] != q.shape[1] or k.shape[3] != q.shape[3]:
        raise ValueError(f"q and k must be [B, H, L, D] of one batch, head count and head dim, got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    b, h, length, d = q.shape
    nk = length // block_size
    if nk < 1 or k.shape[2] != length:
        raise ValueError(f"q and k need the same length of at least block_size, got {q.shape[2]} and {k.shape[2]}")
    n_sel = num_selected(density, nk)
    n_q = min(nk, query_blocks)
    pick = torch.randperm(nk, generator=torch.Generator().manual_seed(seed))[:n_q].to(q.device)
    rows = (pick[:, None] * block_size + torch.arange(block_size, device=q.device)).flatten()
    keys = k[:, :, : nk * block_size].float()
    s = (q[:, :, rows].float() @ keys.transpose(-1, -2)) * d**-0.5  # [B, H, R, Lk] (whole key blocks only)
    p = s.softmax(-1).reshape(b, h, n_q, block_size, nk, block_size)
    mass = p.sum(-1)  # [B, H, nq, bs, Nk]
    top = mass.sum(3).topk(n_sel, dim=-1).indices  # per query block
    sel = torch.zeros(b, h, n_q, nk, dtype=torch.bool, device=q.device).scatter_(-1, top, True)[:, :, :, None, :]
    tail = mass.masked_fill(sel, 0.0)
    spread = s.reshape(b, h, n_q, block_size, nk, block_size).std(-1)
    return {
        "tail_mass": tail.sum(-1).mean((0, 2, 3)).tolist(),
        "tail_block_std": ((spread * tail).sum((0, 2, 3, 4)) / tail.sum((0, 2, 3, 4)).clamp_min(1e-30)).tolist(),
    }


def _check_float(name: str, value, minimum: float = 0.0, strict: bool = False) -> float:
    value = as_float(name, value, "a finite number")  # numpy ints/floats too; TypeError for a bool or str
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < minimum or (strict and value == minimum):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {minimum}, got {value}")
    return float(value)


def _head_types(head_types, heads: int, rank: int) -> list[str]:
    if head_types is None:
        return default_head_types(heads, rank)
    types = list(head_types) if isinstance(head_types, (list, tuple)) else None
    allowed = tuple(HEAD_MIX[rank])
    if types is None or len(types) != heads or any(t not in allowed for t in types):
        raise ValueError(f"head_types must be {heads} entries from {allowed} for a rank-{rank} grid, got {head_types!r}")
    return types


def _kernel_weights(freqs: Tensor, sigma: float) -> Tensor:
    """|a_i|² over log-spaced frequencies for a Gaussian-like kernel of width σ (the factor θ is
    the density of log-spaced frequencies), normalised to K(0) = 1."""
    w = freqs * torch.exp(-0.5 * (freqs * sigma) ** 2)
    return w / w.sum()


def _smooth_field(coords: Tensor, channels: int, lengths, batch: int, gen: torch.Generator) -> Tensor:
    """[batch, L, C] zero-mean unit-variance random field with a Gaussian correlation of length
    ``lengths[axis]`` tokens per axis (random Fourier features)."""
    rank = coords.shape[1]
    inv = torch.tensor([1.0 / x for x in lengths], dtype=_F)[None, :, None]
    omega = torch.randn(batch, rank, _FEATURES, generator=gen, dtype=_F) * inv
    phase = torch.rand(batch, 1, _FEATURES, generator=gen, dtype=_F) * (2 * math.pi)
    z = torch.cos(coords @ omega + phase) * math.sqrt(2.0 / _FEATURES)
    return z @ torch.randn(batch, _FEATURES, channels, generator=gen, dtype=_F)


def _project(field: Tensor, energy: Tensor, logit: float, value: float, d: int, gen):
    """q, k, v [B, H, L, D] from a per-head field [B, H, L, C]: q·k ≈ ``logit / scale`` for equal
    field values (k's projection correlated with q's), v of per-dim std ``value``."""
    heads, channels = field.shape[1], field.shape[-1]
    wq = torch.randn(heads, d, channels, generator=gen, dtype=_F) * energy
    wk = _RHO * wq + math.sqrt(1 - _RHO**2) * torch.randn(heads, d, channels, generator=gen, dtype=_F) * energy
    wv = torch.randn(heads, d, channels, generator=gen, dtype=_F)
    gain = math.sqrt(logit / (_RHO * d * channels * d**-0.5))
    q = torch.einsum("hdc,bhlc->bhld", wq, field) * gain
    k = torch.einsum("hdc,bhlc->bhld", wk, field) * gain
    v = torch.einsum("hdc,bhlc->bhld", wv, field) * (value / math.sqrt(channels))
    return q, k, v


def _rotate(x: Tensor, angles: Tensor) -> Tensor:
    """RoPE on interleaved pairs: x [..., L, D], angles [L, D/2]."""
    xr = x.reshape(*x.shape[:-1], -1, 2)
    cos, sin = angles.cos(), angles.sin()
    a, b = xr[..., 0], xr[..., 1]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


def _grid_qkv(coords: Tensor, types: list[str], d: int, batch: int, gen, p: _Params):
    """Grid q, k, v [B, H, Lg, D] (original order), sink indices and the common direction u [H, D]."""
    heads, lg, rank = len(types), coords.shape[0], coords.shape[1]
    scale = d**-0.5
    freqs = [rope_frequencies(n, p.rope_theta) for n in axis_pairs(d, rank)]
    all_freqs = torch.cat(freqs)
    angles = torch.cat([coords[:, a, None] * freqs[a].to(_F)[None, :] for a in range(rank)], dim=1)  # [Lg, D/2]

    # Positional anchor: |a_i|² = sharpness · gain · w_i / scale (random phase per pair), so the
    # RoPE-rotated q·k carries the head's locality kernel.
    amp = torch.stack([
        torch.cat([gain * _kernel_weights(freqs[a], sigma) for a, (sigma, gain) in enumerate(HEAD_KERNELS[t][3 - rank:])])
        for t in types]) * (p.sharpness / scale)
    phase = torch.rand(heads, d // 2, generator=gen, dtype=torch.float64) * (2 * math.pi)
    anchor = torch.stack((amp.sqrt() * phase.cos(), amp.sqrt() * phase.sin()), dim=-1).flatten(-2).to(_F)  # [H, D]

    # Semantic features live in slowly rotating pairs: energy per pair low-passed at content_band.
    energy = torch.exp(-0.5 * (all_freqs * p.content_band) ** 2)
    energy = (energy / energy.mean()).repeat_interleave(2).sqrt().to(_F)[None, :, None]  # [1, D, 1]
    field = torch.stack([
        _smooth_field(coords, p.content_rank, [p.smoothness * x for x in HEAD_CONTENT[t][3 - rank:]], batch, gen)
        for t in types], dim=1)  # [B, H, Lg, C]
    q, k, v = _project(field, energy, p.content, 1.0, d, gen)
    if p.detail > 0 or p.detail_value > 0:
        fine = _smooth_field(coords, p.content_rank, [p.detail_length] * rank, batch * heads, gen)
        fq, fk, fv = _project(fine.reshape(batch, heads, lg, -1), energy, p.detail, p.detail_value, d, gen)
        q, k, v = q + fq, k + fk, v + fv

    shape = (batch, heads, lg, d)
    qstd = (anchor.square().mean(-1)[None, :, None, None] + (p.content + p.detail) / (_RHO * d * scale)) ** 0.5
    q = q + anchor[None, :, None] + p.noise * qstd * torch.randn(shape, generator=gen, dtype=_F)
    k = k + anchor[None, :, None] + p.noise * qstd * torch.randn(shape, generator=gen, dtype=_F)
    v = v + p.noise * torch.randn(shape, generator=gen, dtype=_F)
    if p.diagonal > 0:
        own = torch.randn(shape, generator=gen, dtype=_F) * math.sqrt(p.diagonal / (scale * d))
        q, k = q + own, k + own
    q, k = _rotate(q, angles), _rotate(k, angles)

    # A common query direction (after RoPE: real q's have a mean) that sinks and text keys use.
    u = torch.randn(heads, d, generator=gen, dtype=_F)
    u = u / u.norm(dim=-1, keepdim=True)
    q = q + _Q_BIAS * u[None, :, None]
    sinks = torch.randperm(lg, generator=gen)[: p.sink_keys].sort().values
    if p.sink_keys:
        k[:, :, sinks] += (p.sink_strength / (scale * _Q_BIAS)) * u[None, :, None]
    if p.outlier_channels:
        ch = torch.randperm(d, generator=gen)[: p.outlier_channels]
        kstd = k.std(dim=(0, 2)).mean(-1)  # [H]
        slow = 1.0 + 0.1 * field[..., :1]  # slowly varying, so the offset is not a pure constant
        k[..., ch] += p.outlier_scale * kstd[None, :, None, None] * slow
    return q, k, v, sinks, u


def _text_qkv(q_grid: Tensor, u: Tensor, n: int, gen, p: _Params):
    """Text q/k/v [B, H, n, D]: iid features at the image tokens' scale, no RoPE (position 0),
    the common direction ``u`` in q and, with ``text_strength``, in k."""
    b, h, _, d = q_grid.shape
    std = q_grid.std(dim=(0, 2), keepdim=True)  # [1, H, 1, D]
    qt = torch.randn(b, h, n, d, generator=gen, dtype=_F) * std
    kt = _RHO * qt + math.sqrt(1 - _RHO**2) * torch.randn(b, h, n, d, generator=gen, dtype=_F) * std
    vt = torch.randn(b, h, n, d, generator=gen, dtype=_F) * math.sqrt(1.0 + p.detail_value**2)
    qt = qt + _Q_BIAS * u[None, :, None]
    kt = kt + (p.text_strength / (d**-0.5 * _Q_BIAS)) * u[None, :, None]
    return qt, kt, vt
