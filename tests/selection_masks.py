"""Test helper: a selection's block indices as a dense bool mask (to compare ``idx`` with ``bits``,
or one backend's selection with another's)."""

import torch
from torch import Tensor


def idx_to_mask(idx: Tensor, cnt: Tensor, n_kv_blocks: int) -> Tensor:
    """The bool ``[B, H, Nq, Nk]`` mask named by the first ``cnt`` entries of ``idx``."""
    valid = torch.arange(idx.shape[-1], device=idx.device) < cnt[..., None]
    mask = torch.zeros(*idx.shape[:-1], n_kv_blocks + 1, dtype=torch.bool, device=idx.device)
    safe = torch.where(valid, idx.long(), torch.full_like(idx, n_kv_blocks, dtype=torch.long))
    mask.scatter_(-1, safe, True)
    return mask[..., :n_kv_blocks]
