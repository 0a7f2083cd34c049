"""Collective helpers on ``torch.distributed`` process groups (no model code, no diffusers).

Token moves are planned on the host from shape-only facts every rank knows (the per-rank lengths
and a global permutation), so a plan is one ``all_to_all_single`` with no extra handshake.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor


def group_info(group) -> tuple[int, int]:
    """(rank, world size) inside ``group`` (``None`` = the default group)."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialised (call init_process_group first)")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the group it was given")
    return rank, dist.get_world_size(group)


def gather_ints(values: list[int], group, device) -> list[list[int]]:
    """All-gather a short list of ints from every rank (one host sync)."""
    _, world = group_info(group)
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return torch.stack(out).tolist()


def all_gather_var(x: Tensor, dim: int, sizes: list[int], group) -> Tensor:
    """Concatenate ``x`` of every rank along ``dim``; rank r's tensor has ``sizes[r]`` rows there."""
    m = max(sizes)
    pad = m - x.shape[dim]
    if pad:
        shape = list(x.shape)
        shape[dim] = pad
        x = torch.cat([x, x.new_zeros(shape)], dim=dim)
    parts = [torch.empty_like(x) for _ in sizes]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim)


def to_device(index: Tensor, device) -> Tensor:
    """A host index tensor on ``device``. non_blocking: a plain H2D copy of pageable memory would
    synchronise the stream, i.e. wait for all queued GPU work, at every attention call."""
    return index.to(device, non_blocking=True)


def bounds_of(lengths: list[int]) -> list[int]:
    """Prefix offsets ``[0, l0, l0+l1, ...]`` of contiguous shards."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def balanced_block_bounds(total: int, block_size: int, world: int) -> list[int]:
    """Shard boundaries on block starts, ``ceil(total / block_size)`` blocks spread evenly."""
    n = -(-total // block_size)
    return [min(total, (r * n // world) * block_size) for r in range(world)] + [total]


@dataclass
class Redistribution:
    """Move tokens of a globally sharded sequence to a new order and sharding (and back).

    New global position ``p`` takes the token at old global position ``perm[p]`` (``perm`` is
    injective: a permutation, or an ordered subset of the old positions); old shard r holds
    ``[src[r], src[r+1])``, new shard r holds ``[dst[r], dst[r+1])`` (both contiguous).
    """

    send_idx: Tensor  # local old positions, grouped by destination rank (CPU int64)
    send_splits: list[int]
    recv_splits: list[int]
    recv_order: Tensor  # received row i goes to local new position recv_order[i] (CPU int64)
    old_len: int  # local length before the move
    identity: bool
    _on_device: dict = field(default_factory=dict, repr=False, compare=False)

    def _index(self, name: str, device) -> Tensor:
        """``send_idx`` / ``recv_order`` on ``device``, copied once per plan (a plan is reused
        across calls, so no host-to-device copy per call)."""
        key = (name, str(device))
        if key not in self._on_device:
            self._on_device[key] = to_device(getattr(self, name), device)
        return self._on_device[key]

    @classmethod
    def build(cls, perm: Tensor | None, src: list[int], dst: list[int], rank: int) -> "Redistribution":
        world = len(src) - 1
        old_len = src[rank + 1] - src[rank]
        if perm is None:
            if src == dst:
                return cls(torch.arange(old_len), [], [], torch.arange(old_len), old_len, True)
            perm = torch.arange(src[-1])
        owner = torch.bucketize(perm, torch.tensor(src[1:]), right=True)  # old owner of each new position
        send, send_splits = [], []
        for d in range(world):
            seg, own = perm[dst[d] : dst[d + 1]], owner[dst[d] : dst[d + 1]]
            mine = seg[own == rank] - src[rank]
            send.append(mine)
            send_splits.append(mine.numel())
        own_here = owner[dst[rank] : dst[rank + 1]]
        recv_splits = torch.bincount(own_here, minlength=world).tolist()
        recv_order = torch.sort(own_here, stable=True).indices  # rows arrive grouped by source rank
        return cls(torch.cat(send), send_splits, recv_splits, recv_order, old_len, False)

    def apply(self, x: Tensor, dim: int, group) -> Tensor:
        """Old sharding -> new: redistribute ``x`` along its sequence dimension ``dim``."""
        if self.identity:
            return x
        rows = x.movedim(dim, 0).index_select(0, self._index("send_idx", x.device)).contiguous()
        got = rows.new_empty((sum(self.recv_splits), *rows.shape[1:]))
        dist.all_to_all_single(got, rows, self.recv_splits, self.send_splits, group=group)
        placed = torch.empty_like(got)
        placed[self._index("recv_order", x.device)] = got
        return placed.movedim(0, dim)

    def reverse(self, y: Tensor, dim: int, group, fill: float = 0.0) -> Tensor:
        """New sharding -> old (the same all-to-all, roles swapped). Old positions that ``perm``
        does not name (a subset plan) are set to ``fill``."""
        if self.identity:
            return y
        rows = y.movedim(dim, 0).index_select(0, self._index("recv_order", y.device)).contiguous()
        got = rows.new_empty((sum(self.send_splits), *rows.shape[1:]))
        dist.all_to_all_single(got, rows, self.send_splits, self.recv_splits, group=group)
        out = rows.new_full((self.old_len, *rows.shape[1:]), fill)
        out[self._index("send_idx", y.device)] = got
        return out.movedim(0, dim)


def check_permutation(perm, total: int, name: str = "perm", subset: bool = False) -> Tensor:
    """Validate ``perm`` as a CPU int64 permutation of ``range(total)`` (or, with ``subset``, an
    ordered selection of distinct positions of it)."""
    if not isinstance(perm, Tensor):
        raise TypeError(f"{name} must be a 1-D integer tensor or None, got {type(perm).__name__}")
    if perm.dim() != 1 or perm.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be a 1-D int32/int64 tensor, got shape {tuple(perm.shape)} {perm.dtype}")
    perm = perm.to("cpu", torch.int64)
    if not subset and perm.numel() != total:
        raise ValueError(f"{name} must have one entry per global token ({total}), got {perm.numel()}")
    if subset and not 0 < perm.numel() <= total:
        raise ValueError(f"{name} must name between 1 and {total} global positions, got {perm.numel()}")
    if perm.numel() and (perm.min() < 0 or perm.max() >= total or torch.bincount(perm, minlength=total).max() != 1):
        what = "distinct positions in range" if subset else "a permutation of range"
        raise ValueError(f"{name} must hold {what}(global sequence length {total})")
    return perm


def inverse_permutation(perm: Tensor) -> Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    return inv


class RingExchange:
    """Pass buffers one hop round the ring (to rank+1, from rank-1), overlapped with compute.

    The sends and receives are issued together (``batch_isend_irecv``); with NCCL they run on the
    process group's own stream, which first waits for the work already queued on the current
    stream, so compute queued after :meth:`start` overlaps them. :meth:`wait` makes the current
    stream (not the host) wait for them.
    """

    def __init__(self, group):
        self.group = group
        self.rank, self.world = group_info(group)
        self.reqs = []

    def start(self, sends: list[Tensor], recvs: list[Tensor]) -> None:
        nxt, prv = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        ops = []
        # Empty shards send nothing; both ends know the sizes, so they skip the same messages.
        for send, recv in zip(sends, recvs):
            if send.numel():
                ops.append(dist.P2POp(dist.isend, send, group=self.group, group_peer=nxt))
            if recv.numel():
                ops.append(dist.P2POp(dist.irecv, recv, group=self.group, group_peer=prv))
        self.reqs = dist.batch_isend_irecv(ops) if ops else []

    def wait(self) -> None:
        for r in self.reqs:
            r.wait()
        self.reqs = []


_ALIGN = 128  # bytes: every packed tensor starts aligned for vector loads


def _packed_offsets(shapes: list[tuple[int, ...]], dtypes: list[torch.dtype]) -> tuple[list[int], int]:
    offsets, pos = [], 0
    for shape, dt in zip(shapes, dtypes):
        offsets.append(pos)
        n = dt.itemsize
        for s in shape:
            n *= s
        pos += -(-n // _ALIGN) * _ALIGN
    return offsets, pos


def all_gather_packed(tensors: list[Tensor], shapes: list[list[tuple[int, ...]]], group) -> list[list[Tensor]]:
    """All-gather several tensors of mixed dtypes in one collective.

    ``tensors``: this rank's; ``shapes[r][i]``: the shape of tensor ``i`` on rank ``r`` (every rank
    knows every shape, so nothing else is exchanged). Returns ``out[r][i]``, contiguous views into
    one received buffer.
    """
    rank, world = group_info(group)
    dtypes = [t.dtype for t in tensors]
    layouts = [_packed_offsets(shapes[r], dtypes) for r in range(world)]
    slot = max(size for _, size in layouts)
    dev = tensors[0].device
    send = torch.empty(slot, dtype=torch.uint8, device=dev)
    for t, off in zip(tensors, layouts[rank][0]):
        n = t.numel() * t.element_size()
        if n:
            send[off : off + n].copy_(t.contiguous().view(-1).view(torch.uint8))
    recv = torch.empty(world * slot, dtype=torch.uint8, device=dev)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(recv, send, group=group)
    out = []
    for r in range(world):
        base, row = r * slot, []
        for shape, dt, off in zip(shapes[r], dtypes, layouts[r][0]):
            n = dt.itemsize
            for s in shape:
                n *= s
            row.append(recv[base + off : base + off + n].view(dt).view(shape))
        out.append(row)
    return out


def order_key(t: Tensor):
    """Cache key of an order tensor (``perm``, ``q_perm``, ``exact_queries``): its identity and
    in-place version; an inference tensor (made under ``torch.inference_mode()``) has no version
    counter, so its contents are the key (one host copy per call)."""
    if t.is_inference():
        return (id(t), tuple(t.shape), str(t.dtype), t.detach().cpu().numpy().tobytes())
    return (id(t), t._version)
