"""Pure-PyTorch statement of PISA's math (the reference every kernel is tested against).

Layout here is always ``[B, H, L, D]`` (callers transpose views, never copies). K/V may have fewer
heads than Q (GQA): query head ``h`` reads kv head ``h // (H // Hk)``.

Notation (paper, Sec. 3.2-3.3, with the softmax scale ``s`` written out):

* key blocks ``j = 0..N-1`` of ``B`` tokens; the last block may hold ``n_j < B`` tokens (ragged);
* centroid ``k̄_j = mean_n k_jn``, value sum ``V̂_j = Σ_n v_jn``;
* ``H_j = Σ_n (k_jn - k̄_j)ᵀ v_jn`` and ``H̄ = (1/N) Σ_j H_j`` (the paper: mean over *all* key
  blocks; with ``hbar_exclude`` the mean over the blocks not excluded, e.g. sink blocks that every
  row computes exactly, whose ``H_j`` would otherwise dominate a term applied to the others);
* ``α_tj = exp(s q_t·k̄_j)``; with ``tail_spread`` (reference only)
  ``α_tj = exp(s q_t·k̄_j + ½ s² q_tᵀ Σ_j q_t)``,
  ``Σ_j`` the block's key covariance (``"gauss"``) or ``tr(Σ_j)/D · I`` (``"trace"``): the block's
  exact ``Σ_n exp(s q·k_n) (1, v_n)`` when its keys are Gaussian and its values linear in them,
  where the paper's ``n_j exp(s q·k̄_j)`` is only a lower bound of the mass (Jensen); ``"taylor"``
  multiplies by ``1 + ½ s² q_tᵀ Σ_j q_t`` instead (the mass to second order, no Gaussian tail),
  ``"taylor-trace"`` by ``1 + ½ s² ||q_t||² tr(Σ_j)/D``.

For query block ``i`` with exact set ``S_i`` and tail ``U_i``::

    D_t = Σ_{j∈S} Σ_n exp(s q_t·k_jn)          + Σ_{j∈U} n_j α_tj
    N_t = Σ_{j∈S} Σ_n exp(s q_t·k_jn) v_jn     + Σ_{j∈U} α_tj V̂_j  + first-order term

    first-order term:  "hybrid": (Σ_{j∈U} α_tj) · s q_t H̄        (global, paper eq. 7; with
                                 hbar_scope="row": H̄_t, the mean of H_j over row t's own tail U_i
                                 less the excluded blocks, a reference-only variant)
                       "first" :  Σ_{j∈U} α_tj · s q_t H_j        (exact block-wise, eq. 5)
                       "zeroth", "drop": none                     ("drop" also has no 0th-order tail)

The first-order factor carries ``s`` because it is the derivative of ``exp(s q·k)`` in ``k``; it
is multiplied by a weight ``alpha_h`` per query head when one is given (``1``: the paper; the
public API's default is :data:`pisa_attn.spec.DEFAULT_ALPHA`).
Everything lives in one softmax with one running maximum: exact scores and centroid scores are
shifted by the same ``m_t``, so a tail block that holds the row maximum is handled like any other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from .. import spec
from ..spec import COV_EPS, MODES, block_counts, expand_kv_heads, num_blocks
from .selection import Selection, check_select_width, check_selection
from .stages import Backend, run_plan, run_stages, slice_blocks

# Elements of one [B, H, rows, Lk] score slab the chunked reference may hold at once (~256 MB fp32).
_SLAB_ELEMS = 1 << 26
# How the tail's block weight accounts for the spread of q·k inside a block (see the module notes):
# "none" the paper's n_j exp(s q·k̄_j); "gauss" exp(½ s² qᵀΣ_j q) with the block's key covariance;
# "trace" the same with Σ_j ≈ tr(Σ_j)/D · I; "taylor" the second-order factor 1 + ½ s² qᵀΣ_j q;
# "taylor-trace" that factor with Σ_j ≈ tr(Σ_j)/D · I (one scalar per block, ||q||² per row).
TAIL_SPREADS = ("none", "gauss", "trace", "taylor", "taylor-trace")


@dataclass
class BlockStats:
    """Per-key-block statistics (the "prepare" stage), float32 (float64 for float64 inputs).

    kmean: [B, Hk, N, D]  block centroids k̄_j (true token counts for the ragged last block)
    vsum:  [B, Hk, N, D]  block value sums V̂_j
    counts:[N]            tokens per block n_j
    hbar:  [B, Hk, D, D]  H̄ = mean_j H_j over the N blocks (or the global H̄ a shard attends with)
    hdev:  [B, Hk, N]     ||H_j - H̄||_F, only when asked (covariance-aware selection)
    qmean: [B, H, Nq, D]  query block means (from :func:`prepare`; selection reads them)
    hbar_in: [B|1, Hk|1, N] 1 for the blocks H̄ is the mean over, 0 for excluded ones (None: all)
    kcov:  [B, Hk, N, D, D] within-block key covariance (1/n_j) Σ_n (k_n − k̄_j)ᵀ(k_n − k̄_j), only
           when asked (the ``tail_spread`` variants of :func:`pisa_forward`; reference only)
    """

    kmean: Tensor
    vsum: Tensor
    counts: Tensor
    hbar: Tensor
    hdev: Tensor | None = None
    qmean: Tensor | None = field(default=None)
    hbar_in: Tensor | None = None
    kcov: Tensor | None = None

    BLOCK_AXES: ClassVar[dict[str, int]] = {"kmean": 2, "vsum": 2, "counts": 0, "hdev": 2, "hbar_in": 2, "kcov": 2}
    SHARD_FIELDS: ClassVar[tuple[str, ...]] = ()

    def blocks(self, lo: int, hi: int) -> "BlockStats":
        return slice_blocks(self, lo, hi)

    def with_hbar(self, hbar: Tensor) -> "BlockStats":
        return BlockStats(self.kmean, self.vsum, self.counts, hbar, self.hdev, self.qmean, self.hbar_in, self.kcov)

    def for_attend(self) -> "BlockStats":
        self.qmean = self.hdev = None  # in place, like every backend's
        return self


def block_width(length: int, block_size: int) -> int:
    """Tokens per block of a sequence padded to whole blocks: ``block_size``, or ``length`` where
    the sequence is one block (a valid block_size may be far longer than the sequence, 2**40, and
    padding that one block would be a multi-terabyte tensor of zeros)."""
    return length if num_blocks(length, block_size) == 1 else block_size


def _pad_to_blocks(x: Tensor, block_size: int) -> Tensor:
    """[B, H, L, D] -> [B, H, N, block, D], zero-padded past L (``block``: :func:`block_width`)."""
    b, h, length, d = x.shape
    n = num_blocks(length, block_size)
    width = block_width(length, block_size)
    pad = n * width - length
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
    return x.reshape(b, h, n, width, d)


def block_means(x: Tensor, block_size: int, dtype=torch.float32) -> Tensor:
    """Block means over the sequence axis with true counts: [B, H, L, D] -> [B, H, N, D]."""
    blocks = _pad_to_blocks(x.to(dtype), block_size)
    counts = block_counts(x.shape[2], block_size, x.device, dtype)
    return blocks.sum(dim=3) / counts[:, None]


def block_stats(k: Tensor, v: Tensor, block_size: int, *, with_hdev: bool = False,
                hbar_exclude: Tensor | None = None, with_kcov: bool = False) -> BlockStats:
    """One pass over k and v: centroids, value sums, H̄ (and ||H_j - H̄||_F when asked).

    Σ_j H_j is one product of the centred keys with the values (no per-block D×D tensor); the
    expansion ``KᵀV − Σ_j k̄_jᵀ V̂_j`` would cancel when the keys share a large component (as
    the Triton prepare, which centres too, explains). ``hbar_exclude`` (bool
    ``[B|1, Hk|1, Nk]``): H̄ is the mean of ``H_j`` over the blocks it leaves (0 if it leaves none),
    and ``||H_j − H̄||_F`` is taken against that H̄ for every block. ``with_kcov``: also each
    block's key covariance (``BlockStats.kcov``).
    """
    dtype = torch.float64 if k.dtype == torch.float64 else torch.float32
    n = num_blocks(k.shape[2], block_size)
    kb = _pad_to_blocks(k.to(dtype), block_size)
    vb = _pad_to_blocks(v.to(dtype), block_size)
    counts = block_counts(k.shape[2], block_size, k.device, dtype)
    kmean = kb.sum(dim=3) / counts[:, None]
    vsum = vb.sum(dim=3)
    kc = kb - kmean[:, :, :, None, :]  # padded rows meet zero values below
    if hbar_exclude is None:
        hsum = torch.einsum("bhnsd,bhnse->bhde", kc, vb)
        hbar = hsum / max(n, 1)  # no blocks (an empty shard): H̄ = 0
    else:
        w = included_blocks(hbar_exclude, n, dtype, k.device)  # [B|1, Hk|1, N]
        hsum = torch.einsum("bhnsd,bhnse->bhde", kc * w[..., None, None], vb)
        hbar = hsum / w.sum(-1).clamp_min(1.0)[..., None, None]
    hdev = None
    if with_hdev:
        hdev = _block_h_deviation(kb, vb, kmean, hbar, counts)
    kcov = None
    if with_kcov:
        valid = (torch.arange(kb.shape[3], device=k.device)[None, :] < counts[:, None]).to(dtype)  # [N, bs]
        kc = kc * valid[:, :, None]
        kcov = torch.einsum("bhnsd,bhnse->bhnde", kc, kc) / counts[:, None, None]
    return BlockStats(kmean=kmean, vsum=vsum, counts=counts, hbar=hbar, hdev=hdev,
                      hbar_in=None if hbar_exclude is None else w, kcov=kcov)


def included_blocks(hbar_exclude: Tensor, n: int, dtype, device) -> Tensor:
    """``1 − hbar_exclude`` as ``dtype`` ``[B|1, Hk|1, N]`` (ValueError naming it on a bad shape)."""
    if hbar_exclude.dtype != torch.bool:
        raise TypeError(f"hbar_exclude must have dtype torch.bool, got {hbar_exclude.dtype}")
    if hbar_exclude.dim() == 1:
        hbar_exclude = hbar_exclude.reshape(1, 1, -1)
    if hbar_exclude.dim() != 3 or hbar_exclude.shape[-1] != n:
        raise ValueError(f"hbar_exclude must have shape [{n}] or [B|1, Hk|1, {n}], got {tuple(hbar_exclude.shape)}")
    return (~hbar_exclude).to(device=device, dtype=dtype)


def deviation(k: Tensor, v: Tensor, stats: BlockStats, hbar: Tensor, block_size: int) -> Tensor:
    """||H_j − H̄||_F ``[B, Hk, N]`` of the key blocks ``stats`` describes, against any ``hbar``
    (e.g. the global H̄ of a sharded sequence)."""
    dtype = stats.kmean.dtype
    kb = _pad_to_blocks(k.to(dtype), block_size)
    vb = _pad_to_blocks(v.to(dtype), block_size)
    return _block_h_deviation(kb, vb, stats.kmean, hbar.to(dtype), stats.counts)


def _block_h_deviation(kb: Tensor, vb: Tensor, kmean: Tensor, hbar: Tensor, counts: Tensor) -> Tensor:
    """||H_j − H̄||_F per block, materialising H_j for a bounded number of blocks at a time."""
    b, h, n, bs, d = kb.shape
    valid = (torch.arange(bs, device=kb.device)[None, :] < counts[:, None]).to(kb.dtype)  # [N, bs]
    out = torch.empty(b, h, n, dtype=kb.dtype, device=kb.device)
    step = max(1, _SLAB_ELEMS // max(1, b * h * d * d))
    for j0 in range(0, n, step):
        j1 = min(n, j0 + step)
        kc = (kb[:, :, j0:j1] - kmean[:, :, j0:j1, None, :]) * valid[j0:j1, :, None]
        hj = torch.einsum("bhnsd,bhnse->bhnde", kc, vb[:, :, j0:j1])
        out[:, :, j0:j1] = torch.linalg.matrix_norm(hj - hbar[:, :, None], ord="fro")
    return out


def selection_scores(qmean: Tensor, kmean: Tensor, scale: float, hdev: Tensor | None = None) -> Tensor:
    """Pooled block scores s·q̄_i·k̄_j (+ log(||H_j − H̄||_F + ε) when ``hdev`` is given):
    [B, H, Nq, Nk] in kmean's dtype."""
    heads = qmean.shape[1]
    km = expand_kv_heads(kmean, heads)
    scores = torch.einsum("bhid,bhjd->bhij", qmean.to(km.dtype), km) * scale
    if hdev is not None:
        scores = scores + torch.log(expand_kv_heads(hdev, heads) + COV_EPS)[:, :, None, :]
    return scores


def select_blocks(scores: Tensor, n_select: int, keep_blocks: Tensor | None = None) -> Tensor:
    """Boolean exact-set mask [B, H, Nq, Nk]: top ``n_select`` blocks per query block, plus the
    ``keep_blocks`` (always exact, not counted against ``n_select``)."""
    n_kv = scores.shape[-1]
    n_select = min(n_select, n_kv)
    if keep_blocks is not None:
        keep = keep_blocks.to(torch.bool)
        while keep.dim() < 4:
            keep = keep.unsqueeze(-2) if keep.dim() == 3 else keep.unsqueeze(0)
        scores = scores.masked_fill(keep, float("-inf"))
    idx = scores.topk(n_select, dim=-1, sorted=False).indices
    selected = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, True)
    if keep_blocks is not None:
        selected = selected | keep
    return selected


def pisa_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    stats: BlockStats,
    selected: Tensor,
    *,
    mode: str,
    scale: float,
    block_size: int,
    out_dtype: torch.dtype | None = None,
    alpha: Tensor | None = None,
    hbar_scope: str = "global",
    tail_spread: str = "none",
) -> tuple[Tensor, Tensor]:
    """PISA attention for a given exact-set mask. Returns (out [B,H,Lq,D] in ``out_dtype``,
    default q's dtype, lse [B,H,Lq] fp32).

    ``alpha``: ``[H]`` weight of the first-order term per query head (None: weight 1, the paper;
    ignored by the modes without that term). ``hbar_scope`` (``"hybrid"`` only): ``"global"`` uses
    ``stats.hbar`` for every row (the paper); ``"row"`` the mean of ``H_j`` over each row's own
    tail blocks (less those ``stats.hbar_in`` excludes), from ``stats.hbar`` and the exact blocks'
    ``s q H_j = Σ_n (s q·k_n − s q·k̄_j) v_n`` (no D×D per block; one key range only, not sharded).
    ``tail_spread`` (one of :data:`TAIL_SPREADS`, a reference-only variant; not ``"none"`` needs
    ``stats.kcov``): every tail block's weight ``α_tj`` (its denominator, zeroth- and first-order
    terms alike) is multiplied by ``exp(½ s² q_tᵀ Σ_j q_t)`` (``"taylor"``: ``1 + ½ s² q_tᵀ Σ_j q_t``;
    the ``-trace`` forms with ``Σ_j ≈ tr(Σ_j)/D · I``).

    Processes query blocks in chunks so no [Lq, Lk] matrix is ever materialised. Works on any
    key range: with ``stats``/``selected`` restricted to local key blocks and a global ``H̄`` it
    yields a partial result that merges with others exactly through the returned LSE (the
    numerator and denominator are both sums over key blocks).
    """
    dtype, spread = _tail_setup(q, stats, mode, hbar_scope, tail_spread)
    b, h, lq, d = q.shape
    lk = k.shape[2]
    nq = num_blocks(lq, block_size)
    kx = expand_kv_heads(k, h)
    vx = expand_kv_heads(v, h)
    kmean = expand_kv_heads(stats.kmean, h).to(dtype)
    vsum = expand_kv_heads(stats.vsum, h).to(dtype)
    hbar = expand_kv_heads(stats.hbar, h).to(dtype)
    counts = stats.counts.to(dtype)
    tok_block = torch.arange(lk, device=q.device) // block_size  # key token -> key block
    hbar_in = _hbar_in(stats, mode, hbar_scope, h, dtype, q.device)
    if alpha is not None:
        if alpha.numel() != h:
            raise ValueError(f"alpha must hold one weight per query head ({h}), got shape {tuple(alpha.shape)}")
        alpha = alpha.to(device=q.device, dtype=dtype).reshape(1, h, 1, 1)

    out = torch.empty(b, h, lq, d, dtype=out_dtype or q.dtype, device=q.device)
    lse = torch.empty(b, h, lq, dtype=torch.float32, device=q.device)
    rows_per_chunk = max(block_size, (_SLAB_ELEMS // max(1, b * h * lk)) // block_size * block_size)
    blocks_per_chunk = max(1, rows_per_chunk // block_size)
    for i0 in range(0, nq, blocks_per_chunk):
        i1 = min(nq, i0 + blocks_per_chunk)
        r0, r1 = i0 * block_size, min(lq, i1 * block_size)
        qc = q[:, :, r0:r1].to(dtype)
        row_block = torch.arange(r0, r1, device=q.device) // block_size - i0
        sel = selected[:, :, i0:i1].index_select(2, row_block)  # [B, H, rows, Nk]
        o, l = _chunk(qc, kx, vx, kmean, vsum, hbar, counts, sel, tok_block, mode, scale, alpha, hbar_in=hbar_in,
                      spread=spread)
        out[:, :, r0:r1] = o.to(out.dtype)
        lse[:, :, r0:r1] = l.float()
    return out, lse


def _chunk(qc, kx, vx, kmean, vsum, hbar, counts, sel, tok_block, mode, scale, alpha=None, hbar_in=None,
           spread=None):
    """One query chunk: exact + tail terms under a shared running maximum (the softmax merge);
    ``alpha`` ([1, H, 1, 1] or None) weights the first-order term; ``hbar_in`` ([B|1, H|1, N],
    hybrid only) asks for each row's own tail H̄ over the blocks it marks; ``spread``: see
    :func:`_spread_stats`."""
    num, corr, denom, m = _terms(qc, kx, vx, kmean, vsum, hbar, counts, sel, tok_block, mode, scale, hbar_in,
                                 spread)
    if corr is not None:
        num = num + (corr if alpha is None else corr * alpha)
    out = num / denom.clamp_min(torch.finfo(qc.dtype).tiny)[..., None]
    lse = m + torch.log(denom)
    return out, lse


def _terms(qc, kx, vx, kmean, vsum, hbar, counts, sel, tok_block, mode, scale, hbar_in=None, spread=None):
    """The parts of one query chunk's output, every one shifted by the row's running maximum ``m``:
    (zeroth-order numerator ``N⁰`` [B, H, rows, D], first-order numerator term ``C`` or None for
    the modes without one, denominator ``D`` [B, H, rows], ``m``). ``sel`` [B, H, rows, Nk] is
    each row's exact set. The output is ``(N⁰ + alpha·C) / D``; ``C`` has no denominator share."""
    dtype = qc.dtype
    exact_tok = sel.index_select(-1, tok_block)  # [B, H, rows, Lk]
    s = torch.einsum("bhrd,bhld->bhrl", qc, kx.to(dtype)) * scale
    s_exact = s.masked_fill(~exact_tok, float("-inf"))
    m = s_exact.amax(dim=-1)
    use_tail = mode != "drop"
    if use_tail:
        c = torch.einsum("bhrd,bhjd->bhrj", qc, kmean) * scale
        c_w = c if spread is None else c + _log_spread(qc, spread, scale)
        c_tail = c_w.masked_fill(sel, float("-inf"))
        m = torch.maximum(m, c_tail.amax(dim=-1))
    # A row with no term at all (possible only for a partial key range, e.g. one ring step in drop
    # mode) keeps m = -inf: shift by 0 instead, so it yields out = 0, lse = -inf and merges cleanly.
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s_exact - m[..., None])
    denom = p.sum(-1)
    num = torch.einsum("bhrl,bhld->bhrd", p, vx.to(dtype))
    corr = None
    if use_tail:
        a = torch.exp(c_tail - m[..., None])  # α_tj · exp(-m), zero on exact blocks
        denom = denom + a @ counts
        num = num + torch.einsum("bhrj,bhjd->bhrd", a, vsum)
        if mode == "hybrid":
            qh = torch.einsum("bhrd,bhde->bhre", qc, hbar) * scale
            if hbar_in is not None:
                qh = _row_tail_qh(qh, s, c, sel, hbar_in, tok_block, vx.to(dtype))
            at = a.sum(-1, keepdim=True)
            # rows without tail weight get no term, also where q·H̄ overflows (0·inf would be NaN)
            corr = torch.where(at > 0, at * qh, torch.zeros((), dtype=dtype, device=qh.device))
        elif mode == "first":
            # Σ_j α_tj s q_t H_j = Σ_{j,n} α_t,j(n) · s (q_t·(k_n − k̄_j(n))) v_n, no D×D per block.
            kc = kx.to(dtype) - kmean.index_select(2, tok_block)
            w = torch.einsum("bhrd,bhld->bhrl", qc, kc) * scale
            w = w * a.index_select(-1, tok_block)
            corr = torch.einsum("bhrl,bhld->bhrd", w, vx.to(dtype))
    return num, corr, denom, m


def row_terms(qr: Tensor, k: Tensor, v: Tensor, stats: BlockStats, exact: Tensor, *, mode: str, scale: float,
              block_size: int, hbar_scope: str = "global",
              tail_spread: str = "none") -> tuple[Tensor, Tensor | None, Tensor]:
    """PISA's output of any query rows split into the parts a tail weight acts on: ``(o⁰, c, lse)``
    with ``o⁰`` the zeroth-order output ``[B, H, R, D]``, ``c`` the normalised first-order
    correction (None for ``"zeroth"``/``"drop"``; ``drop`` gives its own output as ``o⁰``) and the
    LSE of the shared denominator; the output at weight ``alpha`` is ``o⁰ + alpha·c``.

    ``qr`` ``[B, H, R, D]`` are rows in any order, ``exact`` ``[B, H, R, Nk]`` each row's exact set
    (the selection of the query block it belongs to): calibration reads sampled rows this way.
    Computed in float32 (float64 for float64 inputs), in chunks of rows like :func:`pisa_forward`
    (``tail_spread`` as there).
    """
    dtype, spread = _tail_setup(qr, stats, mode, hbar_scope, tail_spread)
    b, h, r, d = qr.shape
    lk = k.shape[2]
    kx, vx = expand_kv_heads(k, h), expand_kv_heads(v, h)
    kmean = expand_kv_heads(stats.kmean, h).to(dtype)
    vsum = expand_kv_heads(stats.vsum, h).to(dtype)
    hbar = expand_kv_heads(stats.hbar, h).to(dtype)
    counts = stats.counts.to(dtype)
    tok_block = torch.arange(lk, device=qr.device) // block_size
    hbar_in = _hbar_in(stats, mode, hbar_scope, h, dtype, qr.device)
    step = max(1, _SLAB_ELEMS // max(1, b * h * lk))
    parts = []
    for r0 in range(0, r, step):
        qc = qr[:, :, r0 : r0 + step].to(dtype)
        num, corr, den, m = _terms(qc, kx, vx, kmean, vsum, hbar, counts, exact[:, :, r0 : r0 + step], tok_block,
                                   mode, scale, hbar_in, spread)
        inv = 1.0 / den.clamp_min(torch.finfo(dtype).tiny)[..., None]
        parts.append((num * inv, None if corr is None else corr * inv, (m + torch.log(den)).float()))
    o0 = torch.cat([x[0] for x in parts], dim=2)
    c = None if parts[0][1] is None else torch.cat([x[1] for x in parts], dim=2)
    return o0, c, torch.cat([x[2] for x in parts], dim=2)


def _tail_setup(q: Tensor, stats: BlockStats, mode: str, hbar_scope: str, tail_spread: str):
    """The checks and working precision shared by :func:`pisa_forward` and :func:`row_terms`:
    ``(dtype, spread statistics)`` (float64 for float64 queries, else float32)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if hbar_scope not in spec.HBAR_SCOPES:
        raise ValueError(f"hbar_scope must be one of {spec.HBAR_SCOPES}, got {hbar_scope!r}")
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return dtype, _spread_stats(stats, mode, tail_spread, q.shape[1], dtype)


def _spread_stats(stats: BlockStats, mode: str, tail_spread: str, heads: int, dtype):
    """What :func:`_log_spread` reads: None (the paper's weights, or a mode without a tail), or
    ``(taylor, Σ)`` with the key covariance ``[B, H, N, D, D]`` ("gauss", "taylor") or ``tr(Σ_j)/D``
    as ``[B, H, N]`` ("trace", "taylor-trace")."""
    if tail_spread not in TAIL_SPREADS:
        raise ValueError(f"tail_spread must be one of {TAIL_SPREADS}, got {tail_spread!r}")
    if tail_spread == "none" or mode == "drop":
        return None
    if stats.kcov is None:
        raise ValueError(f"tail_spread={tail_spread!r} needs the block key covariance: block_stats(with_kcov=True)")
    cov = expand_kv_heads(stats.kcov, heads).to(dtype)
    taylor = tail_spread.startswith("taylor")
    if tail_spread.endswith("trace"):
        return taylor, torch.diagonal(cov, dim1=-2, dim2=-1).mean(-1)
    return taylor, cov


def _log_spread(qc: Tensor, spread: tuple[bool, Tensor], scale: float) -> Tensor:
    """The log of the factor on ``α_tj``: ``½ s² q_tᵀ Σ_j q_t`` (``log1p`` of it for "taylor"),
    ``[B, H, rows, N]``."""
    taylor, cov = spread
    if cov.dim() == 3:  # isotropic: tr(Σ_j)/D · ||q_t||²
        x = 0.5 * scale * scale * (qc * qc).sum(-1, keepdim=True) * cov[:, :, None, :]
    else:
        x = 0.5 * scale * scale * torch.einsum("bhrd,bhjde,bhre->bhrj", qc, cov, qc)
    return torch.log1p(x) if taylor else x


def _hbar_in(stats: BlockStats, mode: str, hbar_scope: str, heads: int, dtype, device) -> Tensor | None:
    """The ``[B|1, H|1, N]`` block weights of a per-row H̄ (None: the global H̄ is used)."""
    if mode != "hybrid" or hbar_scope != "row":
        return None
    n = stats.kmean.shape[2]
    w = torch.ones(1, 1, n, dtype=dtype, device=device) if stats.hbar_in is None else stats.hbar_in.to(dtype)
    return expand_kv_heads(w, heads) if w.shape[1] != 1 else w


def _row_tail_qh(qh, s, c, sel, hbar_in, tok_block, vx):
    """``s q_t H̄_t`` with ``H̄_t`` the mean of ``H_j`` over row ``t``'s tail blocks marked in
    ``hbar_in``: ``(n_in · s q H̄ − Σ_{j∈S, in} s q H_j) / (n_in − |S ∩ in|)``; 0 with no such block."""
    inside = hbar_in[:, :, None, :]  # [B|1, H|1, 1, N]
    n_in = inside.sum(-1)  # [B|1, H|1, 1]
    exact_in = sel.to(s.dtype) * inside  # [B, H, rows, N]
    tok_w = exact_in.index_select(-1, tok_block)  # [B, H, rows, Lk]
    w = torch.where(tok_w > 0, s - c.index_select(-1, tok_block), torch.zeros_like(s))
    qh_exact = torch.einsum("bhrl,bhld->bhrd", w, vx)
    n_tail = n_in - exact_in.sum(-1)  # [B, H, rows]
    qh_row = (n_in[..., None] * qh - qh_exact) / n_tail.clamp_min(1.0)[..., None]
    return torch.where(n_tail[..., None] > 0, qh_row, torch.zeros_like(qh_row))


# ---------------------------------------------------------------- the stage contract (ops/stages.py)
def prepare(q: Tensor, k: Tensor, v: Tensor, block_size: int, *, with_hdev: bool = False,
            lean: bool = False, query_block: int | None = None, hbar_exclude: Tensor | None = None) -> BlockStats:
    """Block statistics of the keys and values plus the means of query blocks of ``query_block``
    rows (default ``block_size``); ``hbar_exclude``: see :func:`block_stats`."""
    stats = block_stats(k, v, block_size, with_hdev=with_hdev, hbar_exclude=hbar_exclude)
    stats.qmean = block_means(q, query_block or block_size, stats.kmean.dtype)
    return stats


def select(
    qmean: Tensor,
    kmean: Tensor,
    *,
    n_select: int,
    width: int | None = None,
    scale: float,
    hdev: Tensor | None = None,
    keep: Tensor | None = None,
    scratch_elems: int | None = None,
    repeat: int = 1,
    n_q_blocks: int | None = None,
    n_keep_max: int | None = None,
) -> Selection:
    """Top-``n_select`` key blocks per query block by pooled score (plus ``keep``, bool
    ``[B|1, H|1, Nk]``), as a :class:`Selection` of index-list width ``width`` (default ``Nk``).

    Scores are computed in chunks of query blocks holding at most ``scratch_elems`` scores
    (default: one slab of the attention's chunking). ``repeat``: each row of ``qmean`` selects
    for that many consecutive query blocks, ``n_q_blocks`` of them in all. ``n_keep_max``: the
    most kept blocks of any row of ``keep``; ``width`` must hold ``min(Nk, n_select +
    n_keep_max)`` blocks (ValueError otherwise, as the kernel backends'). None with ``keep`` and
    a ``width`` below ``Nk``: read from ``keep``, one host synchronisation."""
    nk = kmean.shape[2]
    width = nk if width is None else width
    n_keep_max = check_select_width(width, n_select, nk, keep, n_keep_max)
    if repeat != 1 or n_q_blocks is not None:
        sel = select(qmean, kmean, n_select=n_select, width=width, scale=scale, hdev=hdev, keep=keep,
                     scratch_elems=scratch_elems, n_keep_max=n_keep_max)
        return sel.repeat_rows(repeat, qmean.shape[2] if n_q_blocks is None else n_q_blocks)
    b, h, nq, _ = qmean.shape
    limit = _SLAB_ELEMS if scratch_elems is None else scratch_elems
    step = max(1, limit // max(1, b * h * nk))
    parts = []
    for i0 in range(0, max(nq, 1), step):  # no query blocks: one empty part
        scores = selection_scores(qmean[:, :, i0 : i0 + step], kmean, scale, hdev)
        parts.append(Selection.from_mask(select_blocks(scores, n_select, keep), width))
    if len(parts) == 1:
        return parts[0]
    return Selection(*(torch.cat(x, dim=2) for x in zip(*parts)))


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    stats: BlockStats,
    selection: Selection,
    *,
    mode: str,
    scale: float,
    block_size: int,
    n_select: int | None = None,
    out_dtype: torch.dtype | None = None,
    alpha: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`pisa_forward` under a :class:`Selection` (``n_select`` is unused here) of q's
    batch, heads and query blocks and k's key blocks (ValueError naming ``selection`` otherwise)."""
    nk = num_blocks(k.shape[2], block_size)
    check_selection(selection, q.shape[0], q.shape[1], num_blocks(q.shape[2], block_size), nk, q.device)
    mask = selection.to_mask(nk)
    return pisa_forward(q, k, v, stats, mask, mode=mode, scale=scale, block_size=block_size, out_dtype=out_dtype,
                        alpha=alpha)


def forward(q: Tensor, k: Tensor, v: Tensor, plan, keep: Tensor | None = None, n_keep_max: int | None = None,
            alpha: Tensor | None = None):
    """One call on one device (``plan``: a :class:`pisa_attn.PisaPlan`): (out, lse)."""
    return run_plan(BACKEND, q, k, v, plan, keep, n_keep_max, lean=True, alpha=alpha)[2]


def unsupported_reason(q: Tensor, mode: str, block_size: int) -> str | None:
    return None  # every valid call


def score_scratch(q: Tensor, k: Tensor) -> None:
    return None  # selection chunks only past one attention slab


BACKEND = Backend("reference", prepare, select, attend, deviation, forward, unsupported_reason, score_scratch)


def pisa_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    density: float,
    block_size: int = 64,
    mode: str = "hybrid",
    covariance_aware: bool = False,
    scale: float | None = None,
    keep_blocks: Tensor | None = None,
    alpha: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Whole reference pipeline on ``[B, H, L, D]`` tensors: stats, selection, attention.

    Returns (out, lse, selected). No input validation: :func:`pisa_attn.pisa_attention` does it.
    ``alpha``: ``[H]`` weights of the first-order term (None: 1, the paper's output).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    nk = num_blocks(k.shape[2], block_size)
    _, sel, (out, lse) = run_stages(
        BACKEND, q, k, v, block_size=block_size, n_select=spec.num_selected(density, nk), width=nk, mode=mode,
        scale=scale, covariance_aware=covariance_aware, keep=keep_blocks, alpha=alpha,
    )  # fmt: skip
    return out, lse, sel.to_mask(nk)
