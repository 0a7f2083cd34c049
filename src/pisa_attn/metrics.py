"""Error and tail-mass measurements shared by the accuracy study and the diffusers telemetry.

All inputs are ``[B, H, L, D]``; K/V may have fewer heads than Q (GQA). Nothing here materialises an
``[Lq, Lk]`` matrix for all query rows at once: dense passes run over query-row chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import spec
from .ops import reference as ref
from .settings import as_int

# Elements of one [B, H, rows, Lk] score slab a dense pass holds at once (~64 MB in fp32).
_SLAB = 1 << 24


def _check_tensor(name: str, x) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def _same_shape(out: Tensor, dense: Tensor) -> None:
    _check_tensor("out", out)
    _check_tensor("dense", dense)
    for name, x in (("out", out), ("dense", dense)):
        if x.is_complex():  # float64 conversion would drop the imaginary part
            raise TypeError(f"{name} must be a real tensor, got {x.dtype}")
    if out.shape != dense.shape:  # broadcasting would give a plausible number for the wrong rows
        raise ValueError(f"out and dense must have one shape, got {tuple(out.shape)} and {tuple(dense.shape)}")
    if dense.numel() == 0:  # a mean over nothing is no error measurement
        raise ValueError(f"out and dense must not be empty, got shape {tuple(dense.shape)}")


def _ratio(num: Tensor, den: Tensor) -> Tensor:
    """``num / den``; a zero reference gives 0 where the output equals it, else inf; NaN where
    either is NaN (a NaN reference is no evidence of a small error)."""
    _check_tensor("num", num)
    _check_tensor("den", den)
    # where() discards num / 0; a clamped denominator would shrink the error of a tiny reference
    r = torch.where(den > 0, num / den, torch.where(num > 0, float("inf"), 0.0))
    return torch.where(num.isnan() | den.isnan(), float("nan"), r)


def rel_l1(out: Tensor, dense: Tensor) -> float:
    """Relative L1 error ``mean|o - d| / mean|d|`` over all elements (float64 accumulation)."""
    _same_shape(out, dense)
    d = dense.double()
    return float(_ratio((out.double() - d).abs().mean(), d.abs().mean()))


def rel_l1_per_head(out: Tensor, dense: Tensor) -> Tensor:
    """Relative L1 error per head of ``[B, H, L, D]`` tensors: ``[H]`` float64 (batch, tokens and
    channels pooled)."""
    _same_shape(out, dense)  # also refuses an empty pair, whose means would be NaN or 0 per head
    if dense.dim() != 4:
        raise ValueError(f"rel_l1_per_head needs [B, H, L, D] tensors, got shape {tuple(dense.shape)}")
    d = dense.double()
    return _ratio((out.double() - d).abs().mean(dim=(0, 2, 3)), d.abs().mean(dim=(0, 2, 3)))


@dataclass
class ExactSet:
    """Exact-set mask and pooled block scores of one (density, covariance_aware) choice.

    selected:     bool ``[B, H, Nq, Nk]``, what PISA computes exactly (incl. ``keep_blocks``)
    block_scores: ``[B, H, Nq, Nk]`` plain pooled scores ``s·q̄_i·k̄_j`` (no covariance term), the
                  paper's Figure-3 quantity, whatever score the selection itself used.
    """

    selected: Tensor
    block_scores: Tensor


def check_call(q, k, v, *, density, block_size, mode="hybrid", covariance_aware=False, scale=None) -> None:
    """The checks of a PISA call (:func:`pisa_attn.attention.validate`: ValueError/TypeError naming
    the argument) for the measuring tools built on the reference stages."""
    from .attention import validate  # the one place the call's arguments are checked

    validate(q, k, v, density=density, block_size=block_size, mode=mode, scale=scale, backend="reference",
             covariance_aware=covariance_aware)


def select(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    density: float,
    block_size: int,
    covariance_aware: bool = False,
    scale: float | None = None,
    keep_blocks: Tensor | None = None,
    stats: ref.BlockStats | None = None,
    query_block: int | None = None,
) -> ExactSet:
    """PISA's block selection, by the reference's select stage (the kernels are tested to match
    it); ``stats`` of k/v may be passed in to share them between calls. ``query_block``: rows per
    selection (``pisa_attention``'s); the mask and scores still have a row per query block."""
    check_call(q, k, v, density=density, block_size=block_size, covariance_aware=covariance_aware, scale=scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qb = spec.query_block_factor(query_block, block_size) * block_size
    if stats is not None:
        _check_stats(stats, k, block_size)
    given = stats
    if stats is None or (covariance_aware and stats.hdev is None):
        stats = ref.prepare(q, k, v, block_size, with_hdev=covariance_aware, query_block=qb)  # the prepare stage
    qmean = stats.qmean if stats is not given else ref.block_means(q, qb, stats.kmean.dtype)
    nk, nq = stats.kmean.shape[2], spec.num_blocks(q.shape[2], block_size)
    keep = None
    if keep_blocks is not None:  # checked as pisa_attention checks it (bool, one flag per key block)
        from .attention import normalize_keep_blocks

        keep, _ = normalize_keep_blocks(keep_blocks, q.shape[0], q.shape[1], nk, q.device)
    sel = ref.select(qmean, stats.kmean, n_select=spec.num_selected(density, nk), scale=scale,
                     hdev=stats.hdev if covariance_aware else None, keep=keep, repeat=qb // block_size, n_q_blocks=nq)
    scores = ref.selection_scores(qmean, stats.kmean, scale).repeat_interleave(qb // block_size, dim=2)[:, :, :nq]
    return ExactSet(sel.to_mask(nk), scores)


def _check_stats(stats, k: Tensor, block_size: int) -> None:
    """``stats`` must be k's block statistics at ``block_size`` (another input's would select
    plausible blocks for the wrong keys)."""
    if not isinstance(stats, ref.BlockStats):
        raise TypeError(f"stats must be a reference.BlockStats (ref.block_stats of k and v), got {type(stats).__name__}")
    b, hk, lk, d = k.shape
    want = (b, hk, spec.num_blocks(lk, block_size), d)
    if not isinstance(stats.kmean, Tensor) or tuple(stats.kmean.shape) != want:
        got = tuple(stats.kmean.shape) if isinstance(stats.kmean, Tensor) else type(stats.kmean).__name__
        raise ValueError(f"stats must be the block statistics of k at block_size={block_size}: stats.kmean must "
                         f"have shape {want}, got {got}")
    if stats.kmean.device != k.device:
        raise ValueError(f"stats must be on k's device {k.device}, got stats.kmean on {stats.kmean.device}")
    if stats.hdev is not None and (not isinstance(stats.hdev, Tensor) or tuple(stats.hdev.shape) != want[:3]):
        raise ValueError(f"stats.hdev must have shape {want[:3]}, got "
                         f"{tuple(stats.hdev.shape) if isinstance(stats.hdev, Tensor) else stats.hdev!r}")


@dataclass
class DensePass:
    """Exact attention output plus, per given exact-set mask, the dense softmax mass on the tail.

    out:           ``[B, H, Lq, D]`` in float32 (float64 for float64 inputs)
    tail_mass:     one ``[B, H, Lq]`` tensor per mask: ``ρ_t = Σ_{tail keys} p_t`` (exact softmax)
    tail_estimate: with ``kmean``, one ``[B, H, Lq]`` tensor per mask: the block-wise 0th-order
                   estimate ``Σ_{j∈U} n_j exp(s q_t·k̄_j) / D_t`` of the same mass. By Jensen it is
                   at most ``ρ_t``; a ratio near 1 means the centroid approximation captures the
                   tail (tokens of a tail block score alike), near 0 that PISA's tail terms cannot
                   do much better than dropping it.
    """

    out: Tensor
    tail_mass: list[Tensor]
    tail_estimate: list[Tensor]


def dense_pass(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    block_size: int,
    masks: tuple[Tensor, ...] = (),
    scale: float | None = None,
    kmean: Tensor | None = None,
    row_blocks: Tensor | None = None,
) -> DensePass:
    """Exact softmax attention over query-row chunks, measuring each mask's tail mass on the way
    (and its 0th-order estimate when ``kmean``, the ``[B, Hk, Nk, D]`` key-block means, is given).
    ``row_blocks`` (``[Lq]`` long): the mask row of each query row (default: ``row // block_size``),
    for rows sampled out of order."""
    block_size = _check_dense_args(q, k, v, block_size, masks, kmean, row_blocks, scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, h, lq, d = q.shape
    lk = k.shape[2]
    kx = spec.expand_kv_heads(k, h).to(dtype)
    vx = spec.expand_kv_heads(v, h).to(dtype)
    km = None if kmean is None else spec.expand_kv_heads(kmean, h).to(dtype)
    counts = spec.block_counts(lk, block_size, q.device, dtype)
    nk = counts.numel()
    width = ref.block_width(lk, block_size)
    pad = nk * width - lk
    out = torch.empty(b, h, lq, d, dtype=dtype, device=q.device)
    tails = [torch.empty(b, h, lq, dtype=dtype, device=q.device) for _ in masks]
    estimates = [torch.empty(b, h, lq, dtype=dtype, device=q.device) for _ in masks] if km is not None else []
    rows = max(block_size, (_SLAB // max(1, b * h * lk)) // block_size * block_size)
    for r0 in range(0, lq, rows):
        r1 = min(lq, r0 + rows)
        qc = q[:, :, r0:r1].to(dtype)
        s = torch.einsum("bhrd,bhld->bhrl", qc, kx) * scale
        m = s.amax(dim=-1, keepdim=True)
        p = torch.exp(s - m)
        z = p.sum(-1, keepdim=True)
        p = p / z
        out[:, :, r0:r1] = p @ vx
        if not masks:
            continue
        if pad:
            p = torch.nn.functional.pad(p, (0, pad))
        block_mass = p.reshape(b, h, r1 - r0, nk, width).sum(-1)  # [B, H, rows, Nk]
        # A centroid score is a mean of its block's token scores, so exp(c - m) <= 1: no overflow.
        approx = None if km is None else counts * torch.exp(torch.einsum("bhrd,bhjd->bhrj", qc, km) * scale - m) / z
        row_block = (torch.arange(r0, r1, device=q.device) // block_size if row_blocks is None
                     else row_blocks[r0:r1])
        for i, mask in enumerate(masks):
            sel = mask.index_select(2, row_block)
            tails[i][:, :, r0:r1] = block_mass.masked_fill(sel, 0.0).sum(-1)
            if approx is not None:
                estimates[i][:, :, r0:r1] = approx.masked_fill(sel, 0.0).sum(-1)
    return DensePass(out, tails, estimates)


def _check_qk(q, k, block_size, scale, v=None) -> int:
    """The checks :func:`dense_pass` and :func:`token_scores` share: ``[B, H, L, D]`` tensors, q's
    heads a multiple of k's, a positive int ``block_size`` (numpy's too; returned as an int), a
    valid ``scale``."""
    for name, x in (("q", q), ("k", k)) + ((("v", v),) if v is not None else ()):
        _check_tensor(name, x)
        if x.dim() != 4:
            raise ValueError(f"{name} must be a [B, H, L, D] tensor, got shape {tuple(x.shape)}")
    if v is not None and k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got k {tuple(k.shape)}, v {tuple(v.shape)}")
    b, h, lq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or k.shape[1] < 1 or h % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} does not fit k {tuple(k.shape)} (batch, heads a multiple of k's, head dim)")
    if as_int("block_size", block_size, "a positive int") < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    spec.check_scale(scale)  # a NaN or inf scale would make the reference itself NaN
    return int(block_size)


def _check_dense_args(q, k, v, block_size, masks, kmean, row_blocks, scale=None) -> int:
    """:func:`dense_pass`'s checks: a mismatch fails here by name, not as a broadcasting or
    indexing error deep in the pass (or a silently broadcast mask). Shapes only, no read of
    values (the calibration's fits capture the pass as a CUDA graph); q may differ in dtype from
    k/v (the fits convert k/v to their arithmetic's dtype once)."""
    block_size = _check_qk(q, k, block_size, scale, v=v)
    b, h, lq, d = q.shape
    nk = spec.num_blocks(k.shape[2], block_size)
    if row_blocks is not None:
        _check_tensor("row_blocks", row_blocks)
        if row_blocks.dtype not in (torch.long, torch.int32) or tuple(row_blocks.shape) != (lq,):
            raise ValueError(f"row_blocks must be an integer tensor of shape ({lq},) (one mask row per query row), "
                             f"got {row_blocks.dtype} of shape {tuple(row_blocks.shape)}")
    if not isinstance(masks, (tuple, list)):
        raise TypeError(f"masks must be a tuple of bool tensors, got {type(masks).__name__}")
    for i, m in enumerate(masks):
        _check_tensor(f"masks[{i}]", m)
        if m.dtype != torch.bool:
            raise TypeError(f"masks[{i}] must have dtype torch.bool, got {m.dtype}")
        if m.dim() != 4 or tuple(m.shape[:2]) != (b, h) or m.shape[3] != nk:
            raise ValueError(f"masks[{i}] must have shape [{b}, {h}, Nq, {nk}] (key blocks of {block_size}), "
                             f"got {tuple(m.shape)}")
        if row_blocks is None and m.shape[2] < spec.num_blocks(lq, block_size):
            raise ValueError(f"masks[{i}] has {m.shape[2]} query-block rows, q's {lq} rows need "
                             f"{spec.num_blocks(lq, block_size)}")
    if kmean is not None:
        _check_tensor("kmean", kmean)
        want = (b, k.shape[1], nk, d)
        if tuple(kmean.shape) != want:
            raise ValueError(f"kmean must be the key-block means [B, Hk, Nk, D] = {want}, got {tuple(kmean.shape)}")
    return block_size


def token_scores(
    q: Tensor, k: Tensor, selected: Tensor, *, block_size: int, rows: Tensor, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """Per-token pre-softmax scores ``s·q_t·k_n`` of the sampled query ``rows``: (scores
    ``[B, H, rows, Lk]`` float32, bool mask of the keys in each row's selected blocks).
    ``selected``: bool ``[B, H, Nq, Nk]`` (:attr:`ExactSet.selected` at ``block_size``); ``rows``:
    integer ``[R]`` indices of q's rows."""
    block_size = _check_qk(q, k, block_size, scale)
    b, h, lq, _ = q.shape
    nk = spec.num_blocks(k.shape[2], block_size)
    _check_tensor("selected", selected)
    if selected.dtype != torch.bool:
        raise TypeError(f"selected must have dtype torch.bool, got {selected.dtype}")
    if selected.dim() != 4 or tuple(selected.shape[:2]) != (b, h) or selected.shape[3] != nk:
        raise ValueError(f"selected must have shape [{b}, {h}, Nq, {nk}] (key blocks of {block_size}), "
                         f"got {tuple(selected.shape)}")
    if selected.shape[2] < spec.num_blocks(lq, block_size):
        raise ValueError(f"selected has {selected.shape[2]} query-block rows, q's {lq} rows need "
                         f"{spec.num_blocks(lq, block_size)}")
    _check_tensor("rows", rows)
    if rows.dtype not in (torch.long, torch.int32) or rows.dim() != 1:
        raise ValueError(f"rows must be a 1-D integer tensor of q's row indices, got {rows.dtype} of shape "
                         f"{tuple(rows.shape)}")
    # a negative row would wrap around to the end of q and pick another row's mask
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= lq):
        raise ValueError(f"rows must lie in [0, {lq}) (q's rows), got values in "
                         f"[{int(rows.min())}, {int(rows.max())}]")
    if selected.device != q.device or rows.device != q.device or k.device != q.device:
        raise ValueError(f"q, k, selected and rows must be on one device, got {q.device}, {k.device}, "
                         f"{selected.device} and {rows.device}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kx = spec.expand_kv_heads(k, q.shape[1]).float()
    s = torch.einsum("bhrd,bhld->bhrl", q[:, :, rows].float(), kx) * scale
    tok_block = torch.arange(k.shape[2], device=q.device) // block_size
    exact = selected.index_select(2, rows // block_size).index_select(-1, tok_block)
    return s, exact
