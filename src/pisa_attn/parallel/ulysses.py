"""PISA under Ulysses (head) parallelism.

An all-to-all turns "my slice of the sequence, all heads" into "the whole sequence, my H/N heads";
PISA then runs per head exactly as on one process, and a second all-to-all turns the result back.
The gathered sequence is the rank-major concatenation of the slices. When the single-process token
order differs from it (FLUX shards text and image separately, so ranks hold ``[text_r, image_r]``),
``perm`` restores that order before PISA builds its blocks, so the selection is the same.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ..attention import pisa_attention
from ..spec import expand_kv_heads
from .comm import check_permutation, inverse_permutation, order_key, to_device
from ..settings import UNPASSED as _U
from ..settings import PisaSettings
from .common import Shards, check_inputs, entry_settings, to_layout
from .phases import phase

# fn(q, k, v) on full-sequence [B, h, L, D] tensors of this rank's heads -> out [B, h, L, D], or
# (out, lse [B, h, L]) when the caller wants the LSE back.
HeadFn = Callable[[Tensor, Tensor, Tensor], "Tensor | tuple[Tensor, Tensor]"]


def ulysses_pisa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group=None,
    density: float = _U["density"],
    block_size: int = _U["block_size"],
    mode: str = _U["mode"],
    covariance_aware: bool | None = None,
    scale: float | None = None,
    layout: str = _U["layout"],
    keep_blocks: Tensor | None = None,
    perm: Tensor | None = None,
    return_lse: bool = False,
    backend: str = _U["backend"],
    seq_lens: list[int] | None = None,
    alpha=None,
    query_block: int | None = None,
    settings: PisaSettings | None = None,
):
    """Ulysses-parallel PISA: this rank's slice of ``pisa_attention`` over the global sequence.

    Arguments as :func:`pisa_attn.parallel.ring_pisa_attention` (no ``q_perm``), plus ``backend``
    (passed on to :func:`pisa_attn.pisa_attention`, which runs on the gathered sequence). The query
    heads must be divisible by the group size; kv heads that are not are repeated to the query
    heads first. A per-head ``keep_blocks`` [B, H, Nk] or ``alpha`` [H] follows its heads to their rank.
    ``settings``: a :class:`pisa_attn.PisaSettings` instead of the loose settings arguments.
    """
    what = "ulysses_pisa_attention"
    s, alpha, error = entry_settings(settings, alpha, what=what, deferrable=seq_lens is None and isinstance(q, Tensor),
                                     sharded_keys=False, density=density, block_size=block_size, mode=mode,
                                     covariance_aware=covariance_aware, scale=scale, layout=layout, backend=backend,
                                     query_block=query_block)
    qh, kh, vh, sh = check_inputs(q, k, v, group=group, settings=s, what=what, return_lse=return_lse,
                                  seq_lens=seq_lens, alpha=alpha, pre_error=error)
    inner = s.replace(layout="bhsd")  # the gathered [B, h, L, D] sequence
    heads_here = slice(sh.rank * sh.heads // sh.world, (sh.rank + 1) * sh.heads // sh.world)
    alpha = local_heads(alpha, heads_here)
    keep = local_keep(keep_blocks, sh.heads, heads_here)

    def fn(qf, kf, vf):
        with phase("attend", qf.device):
            return pisa_attention(qf, kf, vf, settings=inner, keep_blocks=keep, return_lse=True, alpha=alpha)

    out, lse = _ulysses(qh, kh, vh, fn, sh, group, perm)
    out = to_layout(out, s.layout)
    return (out, lse) if return_lse else out


def local_heads(alpha, heads: slice):
    """A per-head ``alpha`` (an [H] tensor or sequence) cut to one rank's heads; a number, one
    value (which broadcasts) or None as it is."""
    if isinstance(alpha, Tensor) and alpha.dim() == 1 and alpha.numel() > 1:
        return alpha[heads]
    if isinstance(alpha, (list, tuple)) and len(alpha) > 1:
        return type(alpha)(alpha[heads])
    return alpha


def local_keep(keep, heads: int, here: slice):
    """A per-head ``keep_blocks`` [B, H, Nk] cut to one rank's heads (its head count checked
    first: a cut of another count would run, or fail on one rank only)."""
    if isinstance(keep, Tensor) and keep.dim() == 3 and keep.shape[1] != 1:
        if keep.shape[1] != heads:
            raise ValueError(f"keep_blocks must have 1 or H = {heads} heads, got shape {tuple(keep.shape)}")
        return keep[:, here]
    return keep


def ulysses_attention(
    q, k, v, fn: HeadFn, *, group=None, layout: str = "bhsd", perm: Tensor | None = None, seq_lens=None
):
    """Run ``fn`` (any attention on ``[B, h, L, D]``) head-parallel on the gathered sequence
    (reordered by ``perm`` when given, as in :func:`ulysses_pisa_attention`).

    The building block for callers that wrap PISA themselves (the diffusers backend passes its
    single-process attention). Returns this rank's slice of ``fn``'s result: ``out``, or
    ``(out, lse)`` when ``fn`` returns both.
    """
    qh, kh, vh, sh = check_inputs(q, k, v, group=group, settings=PisaSettings(density=1.0, layout=layout),
                                  what="ulysses_attention", seq_lens=seq_lens)
    res = _ulysses(qh, kh, vh, fn, sh, group, perm)
    if isinstance(res, Tensor):
        return to_layout(res, layout)
    return to_layout(res[0], layout), res[1]


def _ulysses(qh, kh, vh, fn: HeadFn, sh: Shards, group, perm):
    if sh.heads % sh.world:
        raise ValueError(f"Ulysses needs the query heads ({sh.heads}) divisible by the group size ({sh.world})")
    if perm is not None:
        if sh.q_lens != sh.k_lens:
            raise ValueError(f"perm needs q and k/v sharded alike, got q lengths {sh.q_lens}, k lengths {sh.k_lens}")
        perm, inv = _device_order(perm, sum(sh.q_lens), qh.device)
    if sh.kv_heads % sh.world:
        # Exact GQA with fewer kv heads than ranks: each rank needs the kv heads of its query heads.
        kh, vh = expand_kv_heads(kh, sh.heads), expand_kv_heads(vh, sh.heads)
    dev = qh.device
    with phase("a2a", dev):
        if sh.q_lens == sh.k_lens:
            qf, kf, vf = _seq_to_heads([qh, kh, vh], sh.q_lens, sh, group)
        else:
            (qf,) = _seq_to_heads([qh], sh.q_lens, sh, group)
            kf, vf = _seq_to_heads([kh, vh], sh.k_lens, sh, group)
    if perm is not None:
        with phase("permute", dev):
            qf, kf, vf = (x.index_select(2, perm) for x in (qf, kf, vf))
    res = fn(qf, kf, vf)
    out, lse = (res, None) if isinstance(res, Tensor) else res
    if perm is not None:
        with phase("permute", dev):
            out = out.index_select(2, inv)
            lse = None if lse is None else lse.index_select(2, inv)
    with phase("a2a", dev):
        out = _heads_to_seq(out, sh.q_lens, sh, group)
        if lse is not None:
            lse = _heads_to_seq(lse[..., None], sh.q_lens, sh, group)[..., 0]
    return out if lse is None else (out, lse)


_ORDERS: OrderedDict = OrderedDict()


def _device_order(perm: Tensor, total: int, device) -> tuple[Tensor, Tensor]:
    """``perm`` checked, and it and its inverse on ``device``: once per tensor object (and in-place
    version), not per call."""
    if not isinstance(perm, Tensor):  # check_permutation's own message, before the cache
        check_permutation(perm, total)
    key = (order_key(perm), total, str(device))
    hit = _ORDERS.get(key)
    if hit is not None and hit[0] is perm:
        return hit[1], hit[2]
    checked = check_permutation(perm, total)
    entry = (perm, to_device(checked, device), to_device(inverse_permutation(checked), device))
    _ORDERS[key] = entry
    if len(_ORDERS) > 64:
        _ORDERS.popitem(last=False)
    return entry[1], entry[2]


def _seq_to_heads(xs: list[Tensor], lens: list[int], sh: Shards, group) -> list[Tensor]:
    """[B, H_x, L_r, D] slices (one shared length) -> [B, H_x/N, L, D] gathered, one all-to-all."""
    w, lr = sh.world, xs[0].shape[2]
    # Rows [N, L_r, B, h*D]: the chunk for rank d holds its heads; tensors share one message.
    rows = [x.permute(2, 0, 1, 3).reshape(lr, x.shape[0], w, -1).permute(2, 0, 1, 3) for x in xs]
    widths = [r.shape[-1] for r in rows]
    buf = torch.cat(rows, dim=-1).reshape(w * lr, xs[0].shape[0], sum(widths)).contiguous()
    out = buf.new_empty((sum(lens), *buf.shape[1:]))
    dist.all_to_all_single(out, buf, lens, [lr] * w, group=group)
    res = []
    for x, part in zip(xs, out.split(widths, dim=-1)):
        b, hx, _, d = x.shape
        res.append(part.reshape(sum(lens), b, hx // w, d).permute(1, 2, 0, 3))
    return res


def _heads_to_seq(x: Tensor, lens: list[int], sh: Shards, group) -> Tensor:
    """[B, h, L, D] gathered -> [B, h*N, L_r, D] this rank's slice (inverse of ``_seq_to_heads``)."""
    b, h, total, d = x.shape
    w, lr = sh.world, lens[sh.rank]
    buf = x.permute(2, 0, 1, 3).contiguous()  # [L, B, h, D], rank-major rows
    out = buf.new_empty((w * lr, b, h, d))
    dist.all_to_all_single(out, buf, [lr] * w, lens, group=group)
    return out.reshape(w, lr, b, h, d).permute(2, 0, 3, 1, 4).reshape(b, w * h, lr, d)
