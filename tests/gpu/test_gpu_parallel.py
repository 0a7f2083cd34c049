"""GPU checks of the pieces the ring runs per step (skipped without CUDA; one GPU): the one-pass
Triton LSE merge against the PyTorch merge at a real size, and shard selections on the device.

    PYTHONPATH=src python -m pytest tests/gpu/test_gpu_parallel.py -q -s
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from pisa_attn.ops.merge import merge, merge_torch  # noqa: E402
from pisa_attn.ops.selection import Selection  # noqa: E402
from selection_masks import idx_to_mask  # noqa: E402


@pytest.mark.parametrize("n, out_dtype", [(2, torch.bfloat16), (4, torch.bfloat16), (4, None)])
def test_merge_kernel_matches_torch(n, out_dtype):
    """Ring x4 shaped (one rank of Wan-14B 720p: 40 heads, 18 900 queries): float32 partials in the
    [B, L, H, D] layout, a few rows without any term in some partial."""
    g = torch.Generator(device="cuda").manual_seed(n)
    parts = []
    for i in range(n):
        o = torch.randn(1, 18900, 40, 128, generator=g, device="cuda").transpose(1, 2)
        lse = torch.randn(1, 40, 18900, generator=g, device="cuda") * 4
        lse[:, :, i :: 97] = float("-inf")
        o[:, :, i :: 97] = float("nan")
        parts.append((o, lse))
    got, got_lse = merge(parts, out_dtype)  # CUDA partials of one layout: the Triton kernel
    want, want_lse = merge_torch(parts, out_dtype)
    assert got.dtype == want.dtype and got.stride() == parts[0][0].stride() and torch.isfinite(got).all()
    fin = torch.isfinite(want_lse)
    assert torch.equal(fin, torch.isfinite(got_lse)) and (got_lse - want_lse)[fin].abs().max() < 1e-5
    tol = 1e-5 if out_dtype is None else 2**-7
    assert ((got.float() - want.float()).abs() / want.float().abs().clamp_min(1)).max() <= tol
    torch.cuda.synchronize()
    t = []
    for fn in (merge, merge_torch):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fn(parts, out_dtype)
        end.record()
        torch.cuda.synchronize()
        t.append(start.elapsed_time(end) / 5)
    print(f"\n[merge {n} partials -> {out_dtype}] kernel {t[0]:.3f} ms, torch {t[1]:.3f} ms")


def test_shard_selection_on_device():
    g = torch.Generator(device="cuda").manual_seed(0)
    nk, width = 1182, 200
    first = Selection.from_mask(torch.rand(1, 40, 296, nk, generator=g, device="cuda") < 0.15, width)
    mask = idx_to_mask(first.idx, first.cnt, nk)
    sel = Selection.from_mask(mask, width)
    for lo, hi in ((0, 296), (296, 591), (591, 887), (887, nk)):
        got = sel.blocks(lo, hi)
        assert torch.equal(idx_to_mask(got.idx, got.cnt, hi - lo), mask[..., lo:hi])
        assert torch.equal(got.to_mask(hi - lo), mask[..., lo:hi])
