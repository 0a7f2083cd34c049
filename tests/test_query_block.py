"""Selection per query block of 2 or 4 key blocks (``query_block``), against its definition."""

from __future__ import annotations

import pytest
import torch

from pisa_attn import pisa_attention, spec
from pisa_attn.ops import reference as ref
from pisa_attn.attention import get_backend


@pytest.mark.parametrize("lq", [256, 230, 100], ids=["Lq256", "Lq230-ragged", "Lq100-odd-blocks"])
@pytest.mark.parametrize("factor", [2, 4])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_prepare_means_over_query_blocks(lq, factor, backend):
    q = torch.randn(2, 3, lq, 16, dtype=torch.float64)
    k = torch.randn(2, 3, 64, 16, dtype=torch.float64)
    x = (q, k, k) if backend == "reference" else (q.bfloat16(), k.bfloat16(), k.bfloat16())
    stats = get_backend(backend).prepare(*x, 16, query_block=16 * factor)
    torch.testing.assert_close(stats.qmean.double(), ref.block_means(x[0].double(), 16 * factor, torch.float64),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["hybrid", "drop"])
def test_query_block_shares_one_selection_per_pooled_block(mode):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, 32, generator=g, dtype=torch.float64) for n in (230, 300, 300))
    alpha = {"alpha": 1.0} if mode == "hybrid" else {}  # the paper's term, as pisa_forward computes it
    out, lse = pisa_attention(q, k, v, covariance_aware=False, density=0.3, block_size=32, mode=mode, query_block=64, return_lse=True, **alpha)
    # the definition: top-k of the pooled 64-row means, used by both 32-row halves
    stats = ref.block_stats(k, v, 32)
    scores = ref.selection_scores(ref.block_means(q, 64, torch.float64), stats.kmean, 32**-0.5)
    mask = ref.select_blocks(scores, spec.num_selected(0.3, 10)).repeat_interleave(2, dim=2)[:, :, :8]
    o_ref, l_ref = ref.pisa_forward(q, k, v, stats, mask, mode=mode, scale=32**-0.5, block_size=32)
    torch.testing.assert_close(out, o_ref)
    torch.testing.assert_close(lse, l_ref.float())


def test_query_block_one_factor_is_the_default():
    q = torch.randn(1, 2, 128, 16, dtype=torch.float64)
    torch.testing.assert_close(pisa_attention(q, q, q, block_size=32, query_block=32), pisa_attention(q, q, q, block_size=32))


@pytest.mark.parametrize("bad", [48, 96, 512, 0, True, 64.0])
def test_bad_query_block_is_refused(bad):
    q = torch.randn(1, 1, 64, 16)
    with pytest.raises(ValueError, match="query_block"):
        pisa_attention(q, q, q, block_size=32, query_block=bad)


def test_triton_backend_takes_query_block():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 100, 32, generator=g).bfloat16() for _ in range(3))  # 7 blocks, the last ragged
    kw = dict(density=0.3, block_size=16, query_block=32, return_lse=True)
    out, lse = pisa_attention(q, k, v, backend="triton", **kw)
    o_ref, l_ref = pisa_attention(q.double(), k.double(), v.double(), backend="reference", **kw)
    assert ((out.double() - o_ref).abs().sum() / o_ref.abs().sum()) < 1e-2
    assert (lse.double() - l_ref).abs().max() < 1e-2
