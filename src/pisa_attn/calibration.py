"""Weighted first-order tail correction and its closed-form fit against dense attention.

PISA's output for query row ``t`` (notation of :mod:`pisa_attn.ops.reference`) is ``o_t = N_t / D_t``.
The first-order term ``C_t`` (``"hybrid"``: ``(Σ_{j∈U} α_tj) s q_t H̄``; ``"first"``:
``Σ_{j∈U} α_tj s q_t H_j``) enters the numerator only: its denominator share
``Σ_n (k_jn − k̄_j) = 0`` vanishes. Weighting it by a scalar ``w`` therefore gives, row by row,

    o_t(w) = (N⁰_t + w C_t) / D_t = o⁰_t + w c_t,        c_t := C_t / D_t,

exactly affine in ``w``: ``o⁰`` is the zeroth-order output (``w = 0``) and ``o⁰ + c`` the paper's
(``w = 1``). ``D_t``, the running maximum and the LSE do not depend on ``w``; for ``"hybrid"``
``w`` is the same as scaling ``H̄`` by ``w`` (no extra cost in a kernel).

The least-squares weight against the dense output ``o*`` over a set ``R`` of rows and channels
(one head, one layer, or everything) is the 1-D regression of the correction on the residual

    w* = Σ_R ⟨c_t, o*_t − o⁰_t⟩ / Σ_R ‖c_t‖²,

and ``‖r − w c‖² = Σ‖r‖² − 2 w Σ⟨c, r⟩ + w² Σ‖c‖²`` tells what it gains. The fit is on the
normalised rows on purpose: the output error is what matters, and in numerator space each row
would be weighted by ``D_t²``, whose scale is set by the arbitrary per-row max shift. The three
sums are additive, so fits pool over inputs, heads and layers by adding :class:`AlphaStats`.

``alpha`` below is this weight ``w`` (one per query head, or one shared); it is unrelated to the
centroid exponentials the reference's docstring calls ``α_tj``.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from . import metrics, spec, tail_weight
from .ops import reference as ref
from .ops.selection import check_keep_blocks

CORRECTION_MODES = spec.FIRST_ORDER_MODES
FIT_OVER = ("head", "layer")
FIT_BOUNDS = (0.0, 1.0)
"""Where a fitted weight is clamped by the calibration tools: at most the paper's full term, never
its opposite. It matters on some real attention: on a diffusion UNet's layers unclamped
per-head fits reached 11.7 and doubled the held-out error (mean rel-L1 0.295 clamped, 0.531 not);
on DINOv2 it changes no held-out error. It also keeps a fit from few sampled rows sane."""


@dataclass
class TailTerms:
    """PISA's output split into its ``alpha``-free part and its first-order correction.

    base:     ``[B, H, Lq, D]`` zeroth-order output ``o⁰`` (``alpha = 0``)
    corr:     ``[B, H, Lq, D]`` normalised correction ``c``: the output is ``base + alpha · corr``
    lse:      ``[B, H, Lq]`` log-sum-exp of the shared denominator (the same for every ``alpha``)
    selected: ``[B, H, Nq, Nk]`` the exact-set mask both parts used
    """

    base: Tensor
    corr: Tensor
    lse: Tensor
    selected: Tensor

    def output(self, alpha) -> Tensor:
        """``base + alpha · corr`` with ``alpha`` a number, a 0-d tensor or one value per head."""
        return self.base + _alpha_tensor(alpha, self.base.shape[1], self.base) * self.corr


def _alpha_tensor(alpha, heads: int, like: Tensor) -> Tensor:
    """``alpha`` as a tensor broadcasting over ``[B, H, L, D]``; ValueError/TypeError naming it."""
    if not isinstance(alpha, Tensor):  # a number or a sequence, checked as a call's alpha is
        alpha = torch.tensor(tail_weight.host_values(alpha, heads), dtype=torch.float64)
    if isinstance(alpha, Tensor) and not alpha.is_floating_point():
        raise TypeError(f"alpha must be a floating-point tensor, got {alpha.dtype}")
    a = torch.as_tensor(alpha, dtype=like.dtype, device=like.device)
    if a.dim() == 0 or (a.dim() == 1 and a.numel() == 1):  # one value broadcasts, as a float does
        a = a.reshape(1)
    elif a.dim() != 1 or a.numel() != heads:
        raise ValueError(f"alpha must be a scalar or have shape [{heads}] (one per query head), got {tuple(a.shape)}")
    if not bool(torch.isfinite(a).all()):
        raise ValueError(f"alpha must be finite, got {alpha!r}")
    return a.view(1, -1, 1, 1)


def _check_mode(mode: str) -> None:
    if mode not in CORRECTION_MODES:
        raise ValueError(f"mode must be one of {CORRECTION_MODES} (the modes with a first-order term), got {mode!r}")


def tail_terms(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    density: float | None = None,
    selected: Tensor | None = None,
    block_size: int = 64,
    mode: str = "hybrid",
    covariance_aware: bool = False,
    scale: float | None = None,
    keep_blocks: Tensor | None = None,
    stats: ref.BlockStats | None = None,
    hbar_scope: str = "global",
) -> TailTerms:
    """Split PISA's reference output on ``[B, H, L, D]`` tensors into ``o⁰`` and ``c``.

    Give either ``density`` (the reference's selection, with ``covariance_aware``/``keep_blocks``)
    or an exact-set mask ``selected`` ``[B, H, Nq, Nk]``. ``stats``: this k/v's
    :func:`pisa_attn.ops.reference.prepare` at ``block_size`` (None: computed here). Both parts are the reference's own
    (:func:`pisa_attn.ops.reference.row_terms`): one pass, the numerator terms, denominator and
    max shift shared (use float64 inputs for a float64 fit).
    """
    _check_mode(mode)
    if (density is None) == (selected is None):
        raise ValueError("give exactly one of density and selected")
    metrics.check_call(q, k, v, density=1.0 if density is None else density, block_size=block_size, mode=mode,
                       covariance_aware=covariance_aware, scale=scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    nq, nk = spec.num_blocks(q.shape[2], block_size), spec.num_blocks(k.shape[2], block_size)
    keep_blocks = _check_keep(keep_blocks, q, nk)
    if selected is not None:
        ok = (isinstance(selected, Tensor) and selected.dtype == torch.bool and selected.dim() == 4
              and selected.shape[0] in (1, q.shape[0]) and selected.shape[1] in (1, q.shape[1])
              and tuple(selected.shape[2:]) == (nq, nk))
        if not ok:
            got = (f"{selected.dtype} {tuple(selected.shape)}" if isinstance(selected, Tensor)
                   else type(selected).__name__)
            raise ValueError(f"selected must be a bool mask [B|1, H|1, {nq}, {nk}] (query blocks x key blocks), "
                             f"got {got}")
        # the mask already names the exact blocks: a selection rule beside it would be ignored
        if keep_blocks is not None or covariance_aware:
            raise ValueError("keep_blocks and covariance_aware choose the density selection; with selected= "
                             "the mask names the exact blocks (put kept blocks in it)")
        selected = selected.to(q.device)
    if stats is not None:
        want = (k.shape[0], k.shape[1], nk, k.shape[3])
        if not isinstance(stats, ref.BlockStats):
            raise TypeError(f"stats must be the reference's BlockStats, got {type(stats).__name__}")
        if tuple(stats.kmean.shape) != want or tuple(stats.vsum.shape) != want:
            raise ValueError(f"stats must hold k's and v's blocks at block_size={block_size} (kmean and vsum "
                             f"{list(want)}), got kmean {list(stats.kmean.shape)}")
    given = stats
    if stats is None or (covariance_aware and stats.hdev is None):
        stats = ref.prepare(q, k, v, block_size, with_hdev=covariance_aware)  # the prepare stage
    if selected is None:
        qmean = stats.qmean if stats is not given else ref.block_means(q, block_size, stats.kmean.dtype)
        keep = None if keep_blocks is None else keep_blocks.to(q.device)
        selected = ref.select(qmean, stats.kmean, n_select=spec.num_selected(density, nk), scale=scale,
                              hdev=stats.hdev if covariance_aware else None, keep=keep).to_mask(nk)
    row_block = torch.arange(q.shape[2], device=q.device) // block_size
    base, corr, lse = ref.row_terms(q, k, v, stats, selected.index_select(2, row_block), mode=mode, scale=scale,
                                    block_size=block_size, hbar_scope=hbar_scope)
    out_dtype = q.dtype
    return TailTerms(base=base.to(out_dtype), corr=corr.to(out_dtype), lse=lse, selected=selected)


def pisa_alpha_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    density: float,
    alpha,
    block_size: int = 64,
    mode: str = "hybrid",
    covariance_aware: bool = False,
    scale: float | None = None,
    keep_blocks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """PISA with the first-order term weighted by ``alpha`` (a number or one value per query head).

    Returns ``(out, lse, selected)`` like :func:`pisa_attn.ops.reference.pisa_reference`;
    ``alpha = 1`` is the paper's output, ``alpha = 0`` the zeroth-order one.
    """
    _check_mode(mode)
    _alpha_tensor(alpha, q.shape[1], q)  # bad alpha fails before any work
    t = tail_terms(q, k, v, density=density, block_size=block_size, mode=mode,
                   covariance_aware=covariance_aware, scale=scale, keep_blocks=keep_blocks)
    return t.output(alpha), t.lse, t.selected


@dataclass
class AlphaStats:
    """Sufficient statistics of the least-squares fit, per query head (float64 ``[H]`` each).

    cr = Σ⟨c, r⟩, cc = Σ‖c‖², rr = Σ‖r‖² with ``r = dense − o⁰``, over the rows fitted on;
    ``n`` counts the elements. Add two to pool inputs (or layers, if they have as many heads).
    """

    cr: Tensor
    cc: Tensor
    rr: Tensor
    n: Tensor

    def __add__(self, other: AlphaStats) -> AlphaStats:
        if not isinstance(other, AlphaStats):
            return NotImplemented
        if other.cr.shape != self.cr.shape:
            raise ValueError(f"cannot pool AlphaStats of {self.cr.numel()} and {other.cr.numel()} heads")
        return AlphaStats(self.cr + other.cr, self.cc + other.cc, self.rr + other.rr, self.n + other.n)

    def alpha(self, over: str = "head", default=1.0, bounds: tuple[float, float] | None = None) -> Tensor:
        """The least-squares weight: ``[H]`` per head (``over="head"``) or a 0-d tensor shared by all
        heads (``"layer"``), clamped to ``bounds`` when given. A head whose correction is zero on
        every fitted row (no tail) does not constrain it: it gets ``default`` (not clamped), a float
        or one value per head (then the result is ``[H]`` for ``"layer"`` too)."""
        if over not in FIT_OVER:
            raise ValueError(f"over must be one of {FIT_OVER}, got {over!r}")
        bounds = _check_bounds(bounds)
        cr, cc = (self.cr, self.cc) if over == "head" else (self.cr.sum(), self.cc.sum())
        if not bool(torch.isfinite(cr).all() and torch.isfinite(cc).all()):
            # NaN would fail the test below and pass for a head without a tail: the default
            raise ValueError("the fit's statistics are not finite (non-finite q/k/v, scale or dense output); no weight "
                             "can be fitted")
        tiny = torch.finfo(cc.dtype).tiny
        w = cr / cc.clamp_min(tiny)
        if bounds is not None:
            w = w.clamp(*bounds)
        d = torch.as_tensor(default, dtype=cc.dtype, device=cc.device)
        if d.ndim > 1 or d.numel() not in (1, self.cr.numel()):
            raise ValueError(f"default must be a float or one value per head ({self.cr.numel()}), "
                             f"got {d.numel()} values")
        if not bool(torch.isfinite(d).all()):  # it is the weight of every head without a tail
            raise ValueError(f"default must be finite, got {default!r}")
        return torch.where(cc > tiny, w, d.reshape(()) if d.numel() == 1 else d)

    def residual(self, alpha) -> Tensor:
        """``Σ‖r − alpha·c‖²`` per head for a scalar or per-head ``alpha`` (0 is zeroth, 1 the paper)."""
        a = torch.as_tensor(alpha, dtype=self.cr.dtype, device=self.cr.device)
        return self.rr - 2 * a * self.cr + a * a * self.cc


def _check_bounds(bounds) -> tuple[float, float] | None:
    """``bounds`` as ``(lo, hi)`` with ``lo <= hi`` (infinite ends allowed); ValueError/TypeError
    naming it: ``clamp`` would make every weight ``hi`` for ``lo > hi`` and NaN for a NaN end."""
    if bounds is None:
        return None
    if not isinstance(bounds, (tuple, list)) or len(bounds) != 2:
        raise TypeError(f"bounds must be None or a pair (lo, hi) of numbers, got {bounds!r}")
    try:
        lo, hi = (float(x) for x in bounds)
    except (TypeError, ValueError):
        raise TypeError(f"bounds must be None or a pair (lo, hi) of numbers, got {bounds!r}") from None
    if not lo <= hi:  # also NaN
        raise ValueError(f"bounds must be (lo, hi) with lo <= hi, got {bounds!r}")
    return lo, hi


def _check_rows(rows, lq: int):
    """``rows`` (a slice, row positions or a bool mask ``[Lq]``) as an index into ``Lq``, holding
    at least one row; ValueError/TypeError naming it. No rows would fit every head to the default."""
    if isinstance(rows, slice):
        if not range(lq)[rows]:
            raise ValueError(f"rows {rows!r} holds no query row of [0, {lq})")
        return rows
    try:
        t = torch.as_tensor(rows)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"rows must be a slice, row positions (ints) or a bool mask, got {rows!r}") from None
    if t.numel() == 0:  # torch.as_tensor([]) is float
        raise ValueError(f"rows holds no query row of [0, {lq})")
    if t.dtype == torch.bool:
        if t.dim() != 1 or t.numel() != lq:
            raise ValueError(f"rows as a mask must be bool [{lq}], got {tuple(t.shape)}")
        t = t.nonzero().reshape(-1)
    elif t.is_floating_point() or t.is_complex():
        raise TypeError(f"rows must be a slice, row positions (ints) or a bool mask, got {t.dtype}")
    t = t.reshape(-1).long()
    if t.numel() == 0:  # an all-False mask
        raise ValueError(f"rows holds no query row of [0, {lq})")
    bad = [r for r in t.tolist() if not 0 <= r < lq]  # on the host: the fits' row plans read nothing back
    if bad:
        raise ValueError(f"rows must lie in [0, {lq}), got {bad[:4]}")
    return t


def _corr_and_residual(terms: TailTerms, dense: Tensor, rows) -> tuple[Tensor, Tensor]:
    """The correction ``c`` and the residual ``dense − o⁰`` in float64, over query ``rows``."""
    if dense.shape != terms.base.shape:
        raise ValueError(f"dense must have the shape of the PISA output {tuple(terms.base.shape)}, got {tuple(dense.shape)}")
    if rows is not None:
        rows = _check_rows(rows, terms.base.shape[2])
        if isinstance(rows, Tensor):
            rows = rows.to(terms.base.device)
    c, o0, d = terms.corr.double(), terms.base.double(), dense.double()
    if rows is not None:
        c, o0, d = (x[:, :, rows] for x in (c, o0, d))
    return c, d - o0


def alpha_stats(terms: TailTerms, dense: Tensor, rows=None) -> AlphaStats:
    """Fit statistics of ``terms`` against the ``[B, H, Lq, D]`` dense output, over query ``rows``
    (a slice or index tensor into ``Lq``; all rows when None), pooled over batch and channels."""
    c, r = _corr_and_residual(terms, dense, rows)
    dims = (0, 2, 3)
    n = torch.full((c.shape[1],), float(c.shape[0] * c.shape[2] * c.shape[3]), dtype=torch.float64, device=c.device)
    return AlphaStats((c * r).sum(dims), (c * c).sum(dims), (r * r).sum(dims), n)


def fit_alpha(terms: TailTerms, dense: Tensor, *, over: str = "head", rows=None, default: float = 1.0) -> Tensor:
    """Closed-form least-squares ``alpha`` of one input: ``[H]`` (``over="head"``) or 0-d (``"layer"``)."""
    return alpha_stats(terms, dense, rows).alpha(over, default)


def fit_alpha_l1(terms: TailTerms, dense: Tensor, *, over: str = "head", rows=None, default: float = 1.0) -> Tensor:
    """The ``alpha`` minimising ``Σ|r − alpha·c|`` (the rel-L1 metric's own loss) instead of squares.

    ``|r − a c| = |c|·|r/c − a|``: the minimiser is the ``|c|``-weighted median of ``r/c`` over the
    elements with ``c ≠ 0`` (exact, no iteration; not poolable by addition like the squares)."""
    if over not in FIT_OVER:
        raise ValueError(f"over must be one of {FIT_OVER}, got {over!r}")
    c, r = _corr_and_residual(terms, dense, rows)
    if not bool(torch.isfinite(c).all() and torch.isfinite(r).all()):
        raise ValueError("the fit's terms are not finite (non-finite q/k/v, scale or dense output); no weight "
                         "can be fitted")
    heads = c.shape[1]
    c = c.transpose(0, 1).reshape(heads, -1)
    r = r.transpose(0, 1).reshape(heads, -1)
    groups = [(c[h], r[h]) for h in range(heads)] if over == "head" else [(c.reshape(-1), r.reshape(-1))]
    out = [_weighted_median(cg, rg, default) for cg, rg in groups]
    return torch.stack(out) if over == "head" else out[0]


def _weighted_median(c: Tensor, r: Tensor, default: float) -> Tensor:
    nz = c != 0
    if not bool(nz.any()):
        return torch.tensor(float(default), dtype=torch.float64, device=c.device)
    ratio, w = r[nz] / c[nz], c[nz].abs()
    order = ratio.argsort()
    ratio, cw = ratio[order], w[order].cumsum(0)
    i = int(torch.searchsorted(cw, 0.5 * cw[-1]))
    return ratio[min(i, ratio.numel() - 1)]


# --- fits on sampled query rows (what calibrating a running model or a capture file does) ----------
@dataclass
class RowFit:
    """What :func:`fit_rows` measured on some query rows, per query head: the least-squares
    statistics, the dense softmax mass on the tail summed over the rows, and the row count (batch
    rows included). Add two to pool calls, steps or inputs."""

    stats: AlphaStats
    tail_mass: Tensor  # [H] float64
    rows: int

    def __add__(self, other: RowFit) -> RowFit:
        if not isinstance(other, RowFit):
            return NotImplemented
        return RowFit(self.stats + other.stats, self.tail_mass + other.tail_mass, self.rows + other.rows)

    def mean_tail_mass(self) -> Tensor:
        """``[H]``: the mean over the fitted rows of the dense softmax mass PISA approximates."""
        return self.tail_mass / max(self.rows, 1)


def fit_rows(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    density: float,
    rows=None,
    measured: tuple[int, int] | None = None,
    block_size: int = 64,
    mode: str = "hybrid",
    covariance_aware: bool = False,
    scale: float | None = None,
    keep_blocks: Tensor | None = None,
) -> RowFit:
    """Fit statistics of query ``rows`` of ``q`` against dense attention, in float32 (float64 for
    float64 inputs) whatever the inputs' dtype: :func:`fit_rules` for one selection rule."""
    if not isinstance(covariance_aware, bool):
        raise TypeError(f"covariance_aware must be True or False, got {covariance_aware!r}")
    return fit_rules(q, k, v, density=density, rows=rows, measured=measured, block_size=block_size, mode=mode,
                     rules=(covariance_aware,), scale=scale, keep_blocks=keep_blocks)[covariance_aware]


def fit_rules(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    density: float,
    rows=None,
    measured: tuple[int, int] | None = None,
    block_size: int = 64,
    mode: str = "hybrid",
    rules: tuple[bool, ...] = (False, True),
    scale: float | None = None,
    keep_blocks: Tensor | None = None,
) -> dict[bool, RowFit]:
    """Fit statistics of query ``rows`` against dense attention under each selection rule in
    ``rules`` (``covariance_aware`` False / True): ``{rule: RowFit}``.

    ``q`` ``[B, H, Lq, D]`` are the query rows as PISA runs them (query block ``i`` is rows
    ``[i·block_size, (i+1)·block_size)``, its selection made from all of them), ``k``/``v``
    ``[B, Hk, Lk, D]``; ``rows``: row positions to fit on (ints or a tensor; None: all);
    ``measured``: the range ``[lo, hi)`` rows must lie in (others, e.g. text rows sharing the
    first image block, are left out). The stages are the reference's: its key statistics, its
    selection of the rows' query blocks (``density``, the rule, ``keep_blocks``) and its per-row
    zeroth-order output and first-order correction (:func:`pisa_attn.ops.reference.row_terms`);
    the dense output and tail mass of the rows come from one dense pass shared by the rules
    (:func:`pisa_attn.metrics.dense_pass`). About ``rows / Lq`` of the call's attention per rule,
    plus the key statistics.
    """
    _check_mode(mode)
    rules = tuple(dict.fromkeys(_check_rules(rules)))
    metrics.check_call(q, k, v, density=density, block_size=block_size, mode=mode, scale=scale)
    keep_blocks = _check_keep(keep_blocks, q, spec.num_blocks(k.shape[2], block_size))
    plan = row_plan(q.shape[2], block_size, rows, measured)
    b, h, _, d = q.shape
    sums = _fit_sums(*plan.gather(q), plan.which(q.device), k, v, keep_blocks, density=density, rules=rules,
                     mode=mode, scale=d**-0.5 if scale is None else scale, block_size=block_size)
    return row_fits(sums, rules, rows=b * len(plan.pos), elems=b * len(plan.pos) * d)


def _check_keep(keep_blocks, q: Tensor, nk: int) -> Tensor | None:
    """``keep_blocks`` checked as a call's is (bool, ``[Nk]`` or ``[B|1, H|1, Nk]``), as a 3-D view."""
    return check_keep_blocks(keep_blocks, q.shape[0], q.shape[1], nk, q.device)


def _check_rules(rules) -> tuple[bool, ...]:
    if not isinstance(rules, (tuple, list)) or not rules or any(not isinstance(r, bool) for r in rules):
        raise ValueError(f"rules must be a non-empty tuple of True/False (covariance-aware or not), got {rules!r}")
    return tuple(rules)


@dataclass(frozen=True)
class RowPlan:
    """Where sampled query rows sit: ``pos`` the sorted row positions, ``blocks`` their query blocks
    (ascending), ``spans`` each block's ``[a, e)`` rows, ``runs`` the rows as ``[a, e)`` runs of
    consecutive rows inside one block. Host-side only: nothing here touches a device."""

    pos: tuple[int, ...]
    blocks: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]
    runs: tuple[tuple[int, int], ...]

    def gather(self, q: Tensor) -> tuple[Tensor, Tensor]:
        """(the rows' whole query blocks ``[B, H, Σ spans, D]``, the rows ``[B, H, R, D]``): views
        and one concatenation each, no index tensor copied to the device."""
        return (torch.cat([q[:, :, a:e] for a, e in self.spans], dim=2),
                torch.cat([q[:, :, a:e] for a, e in self.runs], dim=2))

    def shape_key(self) -> tuple:
        """What a captured fit depends on: the blocks' lengths and the runs' (block, length), not
        where they sit."""
        return tuple(e - a for a, e in self.spans), tuple((self.block_of(a), e - a) for a, e in self.runs)

    def block_of(self, row: int) -> int:
        """Index into ``blocks`` of the block holding ``row``."""
        for i, (a, e) in enumerate(self.spans):
            if a <= row < e:
                return i
        raise ValueError(f"row {row} is in none of the sampled blocks")

    def which(self, device) -> Tensor:
        """``[R]`` long: each row's index into ``blocks`` (the mask row it reads)."""
        return torch.cat([torch.full((e - a,), self.block_of(a), device=device, dtype=torch.long)
                          for a, e in self.runs])


def row_plan(lq: int, block_size: int, rows=None, measured: tuple[int, int] | None = None) -> RowPlan:
    """The :class:`RowPlan` of query ``rows`` (None: all) of ``lq`` rows inside ``measured``;
    ValueError when none is left."""
    bs = block_size
    lo, hi = (0, lq) if measured is None else _check_measured(measured, lq)
    if rows is None:
        pool = range(lo, hi)
    else:
        t = _check_rows(rows, lq)  # the rows alpha_stats takes
        pool = range(lq)[t] if isinstance(t, slice) else t.tolist()
    pos = sorted({int(r) for r in pool if lo <= int(r) < hi})
    if not pos:
        raise ValueError(f"rows {rows!r} hold no query row of [0, {lq}) inside measured={measured!r}")
    # Whole blocks in ascending order: a ragged last block comes last, so the concatenation is
    # blocks of its own.
    blocks = tuple(sorted({p // bs for p in pos}))
    spans = tuple((i * bs, min(lq, (i + 1) * bs)) for i in blocks)
    return RowPlan(tuple(pos), blocks, spans, tuple(_runs(pos, bs)))


SUMS = ("cr", "cc", "rr", "tail_mass")
"""The rows of :func:`_fit_sums`' result, per rule and query head."""


def _fit_sums(qblocks: Tensor, qr: Tensor, which: Tensor, k: Tensor, v: Tensor, keep_blocks: Tensor | None, *,
              density: float, rules: tuple[bool, ...], mode: str, scale: float, block_size: int) -> Tensor:
    """The arithmetic of :func:`fit_rules` on gathered rows, device ops only (no host read, no
    Python branch on values), so that it can be captured as one CUDA graph: ``[len(rules), 4, H]``
    float64, per rule the sums :data:`SUMS` over batch, rows and channels.

    ``qblocks`` the rows' whole query blocks (their selection), ``qr`` the rows, ``which`` each
    row's block. On CPU (and for float32/float64, ``mode="first"`` or shapes the kernels do not
    take) this is the reference's arithmetic: ``k``/``v`` are converted to the fit's dtype once,
    shared by the key statistics, the dense pass and every rule's row terms. On CUDA with
    float16/bfloat16 inputs it is :func:`pisa_attn.ops.triton.fit.fit_sums` (the kernels' key
    statistics and selection, one pass of the rows over k and v, one merge)."""
    if fast_fit_supported(qr, mode, block_size, kv_len=k.shape[2]):
        from .ops.triton import fit as tfit

        r, nb = qr.shape[2], -(-qblocks.shape[2] // block_size)
        rows = torch.arange(r, device=qr.device, dtype=torch.int32)
        starts = torch.arange(0, nb * block_size, block_size, device=qr.device, dtype=torch.int32)
        return tfit.fit_sums(qr, rows, starts, which, k, v, keep_blocks, density=density, rules=rules, scale=scale,
                             block_size=block_size, q_blocks=qblocks)
    bs = block_size
    dtype = torch.float64 if qr.dtype == torch.float64 else torch.float32
    k, v = k.to(dtype), v.to(dtype)
    stats = ref.block_stats(k, v, bs, with_hdev=any(rules))
    nk = stats.kmean.shape[2]
    qmean = ref.block_means(qblocks, bs, dtype)
    keep = None if keep_blocks is None else keep_blocks.to(qr.device, non_blocking=True)
    n_sel = spec.num_selected(density, nk)
    # The reference select stage's scores and top-k, as masks (no index-list round trip).
    sels = [ref.select_blocks(ref.selection_scores(qmean, stats.kmean, scale, stats.hdev if r else None), n_sel, keep)
            for r in rules]  # [B, H, blocks, Nk]
    dense = metrics.dense_pass(qr, k, v, block_size=bs, masks=tuple(sels), scale=scale, row_blocks=which)
    d_out = dense.out.double()
    dims = (0, 2, 3)
    out = []
    for sel, tail in zip(sels, dense.tail_mass):
        o0, corr, _ = ref.row_terms(qr, k, v, stats, sel.index_select(2, which), mode=mode, scale=scale, block_size=bs)
        res = d_out - o0.double()
        c = corr.double()
        out.append(torch.stack(((c * res).sum(dims), (c * c).sum(dims), (res * res).sum(dims),
                                tail.double().sum(dim=(0, 2)))))
    return torch.stack(out)


def fast_fit_supported(qr: Tensor, mode: str, block_size: int, *, kv_len: int | None = None) -> bool:
    """Whether :func:`_fit_sums` takes the Triton fit (:mod:`pisa_attn.ops.triton.fit`): CUDA,
    ``"hybrid"``, a dtype, head dim and block size the Triton kernels take, and (``kv_len``: the
    keys' length) no more key blocks than the fit's selection indexes; else the reference fit."""
    if not qr.is_cuda or mode != "hybrid":
        return False
    from .ops.triton import fit as tfit
    from .ops.triton import op as triton_op

    if kv_len is not None and spec.num_blocks(kv_len, block_size) > tfit.MAX_KEY_BLOCKS:
        return False
    return triton_op.unsupported_reason(qr, mode, block_size) is None


def row_fits(sums: Tensor, rules: tuple[bool, ...], *, rows: int, elems: int) -> dict[bool, RowFit]:
    """``{rule: RowFit}`` from :func:`_fit_sums`' stacked sums (pooled by adding them) over
    ``rows`` rows (batch rows included) of ``elems`` elements (rows x channels)."""
    n = torch.full((sums.shape[-1],), float(elems), dtype=torch.float64, device=sums.device)
    return {r: RowFit(AlphaStats(s[0], s[1], s[2], n), s[3], rows) for r, s in zip(rules, sums.unbind(0))}


class FitGraphs:
    """:func:`fit_rules`' arithmetic for sampled rows, as a calibrated layer call runs it.

    On CUDA with float16/bfloat16 inputs and ``"hybrid"`` (:func:`fast_fit_supported`) a call is
    the Triton fit (:func:`pisa_attn.ops.triton.fit.fit_sums`) launched directly on q, k and v in
    place (nothing gathered): the kernels' prepare and select stages, one pass of the rows over k
    and v, one merge; eight launches and one copy of the rows' positions from pinned memory, no
    host synchronisation (kept blocks given on the host are copied once).

    Elsewhere (float32 inputs, ``mode="first"``) the reference arithmetic is a couple of hundred
    small kernels, whose launches cost more than the fit's arithmetic on a GPU; there each call
    shape's fit is one CUDA graph, replayed: a call copies its inputs into the static buffers of
    its shape's graph (a copy per sampled query block and per run of rows, one each for k, v and
    the kept blocks). The first call of a shape captures (a side-stream warm-up and a capture,
    which synchronise once). Graphs are kept per shape, dtype, device, rows layout and settings,
    the ``max_graphs`` most recent ones (each holds its static inputs; the graphs of a device share
    one memory pool, which is safe because they run one at a time and each output is added up
    before the next replay).

    ``capture=False`` runs the same static-buffer path op by op (the CPU, tests, and a call made
    while ``torch.compile`` traces)."""

    def __init__(self, max_graphs: int = 8):
        self.max_graphs = max_graphs
        self._entries: OrderedDict = OrderedDict()
        self._pools: dict = {}
        self._keep: OrderedDict = OrderedDict()

    def clear(self) -> None:
        self._entries.clear()
        self._pools.clear()
        self._keep.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def sums(self, q: Tensor, k: Tensor, v: Tensor, plan: RowPlan, *, density: float, rules: tuple[bool, ...],
             mode: str, scale: float, block_size: int, keep_blocks: Tensor | None = None,
             capture: bool = True) -> Tensor:
        """:func:`_fit_sums` of ``plan``'s rows of ``q`` ``[B, H, Lq, D]`` against ``k``/``v``:
        ``[len(rules), 4, H]`` (a graph's output buffer, valid until its next replay: add it up or
        clone it)."""
        settings = dict(density=density, rules=tuple(rules), mode=mode, scale=scale, block_size=block_size)
        if fast_fit_supported(q, mode, block_size, kv_len=k.shape[2]) and not torch.compiler.is_compiling():
            from .ops.triton import fit as tfit

            return tfit.fit_sums(q, *self._rows_map(plan, q.device), k, v, self.on_device(keep_blocks, q.device),
                                 density=density, rules=tuple(rules), scale=scale, block_size=block_size)
        if torch.compiler.is_compiling():  # traced: plain ops, nothing cached
            return _fit_sums(*plan.gather(q), plan.which(q.device), k, v, keep_blocks, **settings)
        capture = capture and q.is_cuda
        key = (tuple(q.shape[:2]), q.shape[3], q.dtype, tuple(k.shape), k.dtype, tuple(v.shape), v.dtype,
               None if keep_blocks is None else (tuple(keep_blocks.shape), keep_blocks.dtype), str(q.device),
               plan.shape_key(), float(density), tuple(rules), mode, float(scale), block_size, capture,
               torch.is_inference_mode_enabled())
        entry = self._entries.get(key)
        if entry is None:
            entry = _FitEntry(q, k, v, plan, keep_blocks, settings)
            self._entries[key] = entry
            while len(self._entries) > self.max_graphs:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        entry.load(q, k, v, plan, keep_blocks)
        if capture and entry.graph is None:
            pool = self._pools.setdefault(str(q.device), torch.cuda.graph_pool_handle())
            entry.capture(pool)
        return entry.run()

    def on_device(self, keep: Tensor | None, device) -> Tensor | None:
        """``keep`` on ``device``, copied once per host tensor (a layout's kept blocks live on the
        host; a host-to-device copy of pageable memory per call would synchronise the stream).
        Kept blocks are read-only: a host tensor changed in place is not copied again."""
        if keep is None or keep.device == torch.device(device):
            return keep
        key = (keep.data_ptr(), tuple(keep.shape), tuple(keep.stride()), keep.dtype, str(device))
        hit = self._keep.get(key)
        if hit is None:
            hit = self._keep[key] = (keep, keep.to(device))  # the host tensor is held: its address stays its own
            while len(self._keep) > 64:
                self._keep.popitem(last=False)
        return hit[1]

    @staticmethod
    def _rows_map(plan: RowPlan, device) -> tuple[Tensor, Tensor, Tensor]:
        """``plan``'s row positions, its blocks' first rows and ``plan.which``, int32 on ``device``:
        what the Triton fit reads q through in place. One host-to-device copy from pinned memory
        (no stream synchronisation); the rows are drawn anew per call, so nothing is cached."""
        host = torch.tensor([*plan.pos, *(a for a, _ in plan.spans), *(plan.block_of(a) for a, e in plan.runs
                                                                        for _ in range(e - a))], dtype=torch.int32)
        flat = host.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else host
        r, nb = len(plan.pos), len(plan.spans)
        return flat[:r], flat[r : r + nb], flat[r + nb :]


class _FitEntry:
    """Static inputs of one call shape's fit, and its captured graph once there is one."""

    def __init__(self, q, k, v, plan: RowPlan, keep, settings: dict):
        b, h, _, d = q.shape
        rows = sum(e - a for a, e in plan.runs)
        span = sum(e - a for a, e in plan.spans)
        self.qblocks = q.new_empty(b, h, span, d)
        self.qr = q.new_empty(b, h, rows, d)
        self.k = torch.empty_like(k, memory_format=torch.contiguous_format)
        self.v = torch.empty_like(v, memory_format=torch.contiguous_format)
        self.keep = None if keep is None else torch.empty_like(keep, device=q.device)
        self.which = plan.which(q.device)
        self.settings = settings
        self.graph = None
        self.out = None

    def load(self, q, k, v, plan: RowPlan, keep) -> None:
        _fill(self.qblocks, q, plan.spans)
        _fill(self.qr, q, plan.runs)
        self.k.copy_(k, non_blocking=True)
        self.v.copy_(v, non_blocking=True)
        if keep is not None:
            self.keep.copy_(keep, non_blocking=True)

    def _fit(self) -> Tensor:
        return _fit_sums(self.qblocks, self.qr, self.which, self.k, self.v, self.keep, **self.settings)

    def capture(self, pool) -> None:
        # A warm-up on a side stream before capturing (CUDA graph rules: lazy initialisation,
        # the allocator's first blocks), then the capture.
        dev = self.qr.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            self._fit()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.out = self._fit()
        self.graph = graph

    def run(self) -> Tensor:
        if self.graph is None:
            return self._fit()
        self.graph.replay()
        return self.out


def _fill(dst: Tensor, src: Tensor, spans) -> None:
    """Copy ``src``'s row ``spans`` (along dim 2) one after another into ``dst``."""
    at = 0
    for a, e in spans:
        dst[:, :, at : at + e - a].copy_(src[:, :, a:e], non_blocking=True)
        at += e - a


def choose_rules(fits: dict[str, dict[int, dict[bool, RowFit]]], *, over: str = "head", default: float = 1.0,
                 bounds=FIT_BOUNDS, require_tail: bool = True
                 ) -> tuple[dict[str, dict[int, RowFit]], dict[str, dict[int, bool]]]:
    """Per transformer and layer, the selection rule (covariance-aware or not) whose fit, at its own
    clamped least-squares weights, leaves the smaller squared error on the fitted rows: ``(fits of
    the chosen rules, {name: {layer: rule}})``. Ties keep top-k (no extra prepare pass).

    ``require_tail``: a fit that cannot be made is a ValueError naming the layer, not a weight of
    ``default``: a head (``over="head"``; the layer for ``"layer"``) whose first-order term is zero
    on every fitted row under the chosen rule (no tail: every key block exact at this density, or
    ``H̄ = 0``). The online calibration passes False: there such a layer runs like the fitted rows,
    where the weight changes nothing, and keeps its uncalibrated weight."""
    chosen: dict[str, dict[int, RowFit]] = {}
    rules: dict[str, dict[int, bool]] = {}
    for name, layers in fits.items():
        chosen[name], rules[name] = {}, {}
        for layer, by_rule in layers.items():
            def err(rule: bool) -> float:
                st = by_rule[rule].stats
                return float(st.residual(st.alpha(over, default=default, bounds=bounds)).sum())
            rule = min(sorted(by_rule), key=err)  # False first: a tie keeps top-k
            if require_tail:
                _check_fittable(by_rule[rule].stats, over, f"layer {layer} of {name!r}")
            chosen[name][layer], rules[name][layer] = by_rule[rule], rule
    return chosen, rules


def _check_fittable(st: AlphaStats, over: str, where: str) -> None:
    cc = st.cc if over == "head" else st.cc.sum().reshape(1)
    none = (~(cc > torch.finfo(cc.dtype).tiny)).nonzero().flatten().tolist()
    if none:
        which = "" if over == "layer" else f" (heads {none})"
        raise ValueError(f"{where}: the first-order term is zero on every fitted row{which}: no tail (every key "
                         "block exact at this density) or H̄ = 0, so no weight can be fitted; fit at the density "
                         "you run with, on calls with more key blocks")


def _check_measured(measured, lq: int) -> tuple[int, int]:
    # rows outside [0, lq) would make a plan of rows q does not have
    try:
        if not isinstance(measured, (tuple, list)) or len(measured) != 2 or any(isinstance(x, bool) for x in measured):
            raise TypeError
        lo, hi = (operator.index(x) for x in measured)
    except TypeError:
        raise TypeError(f"measured must be None or a pair (lo, hi) of ints, got {measured!r}") from None
    if not 0 <= lo <= hi <= lq:
        raise ValueError(f"measured must be a range [lo, hi) inside the {lq} query rows, got {tuple(measured)!r}")
    return lo, hi


def _runs(pos: list[int], bs: int) -> list[tuple[int, int]]:
    """Sorted positions as ``[a, e)`` runs of consecutive positions that stay inside one block."""
    runs: list[list[int]] = []
    for p in pos:
        if runs and runs[-1][1] == p and p % bs:
            runs[-1][1] = p + 1
        else:
            runs.append([p, p + 1])
    return [(a, e) for a, e in runs]
