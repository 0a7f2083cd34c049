"""Edge cases of the LSE merge of attention partials: large and infinite LSEs, through the
PyTorch merge and the one-pass Triton kernel (interpreted on the CPU)."""

from __future__ import annotations

import os

import pytest
import torch

from pisa_attn.ops.merge import merge, merge_torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _merges():
    fns = [pytest.param(merge_torch, id="torch")]
    if INTERPRETED:
        from pisa_attn.ops.triton import merge as kernel

        fns.append(pytest.param(kernel.merge, id="triton"))
    return fns


@pytest.mark.parametrize("fn", _merges())
@pytest.mark.parametrize("big", [1e4, 1e8, 3e38])
def test_merge_weights_sum_to_one_at_large_lse(fn, big):
    """Partials with a large common LSE: float32 rounds ``log Σ exp`` back to the largest term, so
    weights ``exp(lse_r − lse)`` taken against that rounded LSE no longer sum to 1; the output is
    normalised by the weights' own sum, as at any other scale."""
    g = torch.Generator().manual_seed(0)
    o = torch.randn(1, 2, 5, 16, generator=g)
    lse = torch.full((1, 2, 5), big)
    out, got_lse = fn([(o, lse), (o.clone(), lse.clone()), (o.clone(), lse.clone())])
    torch.testing.assert_close(out, o, rtol=1e-6, atol=1e-6)  # three copies of o average to o
    assert torch.isfinite(got_lse).all() and (got_lse >= big).all()


@pytest.mark.parametrize("fn", _merges())
def test_merge_posinf_lse_takes_that_partial(fn):
    """A partial whose LSE overflowed to +inf outweighs every finite one: the merged row is its
    output with lse +inf (two such partials: their mean), never NaN; rows with no term anywhere
    stay (0, -inf)."""
    g = torch.Generator().manual_seed(1)
    inf = float("inf")
    a, b = torch.randn(1, 1, 4, 16, generator=g), torch.randn(1, 1, 4, 16, generator=g)
    la = torch.tensor([[[inf, inf, 1.0, -inf]]])
    lb = torch.tensor([[[2.0, inf, -inf, -inf]]])
    out, lse = fn([(a, la), (b, lb)])
    assert torch.equal(lse, torch.tensor([[[inf, inf, 1.0, -inf]]]))
    torch.testing.assert_close(out[..., 0, :], a[..., 0, :])
    torch.testing.assert_close(out[..., 1, :], (a[..., 1, :] + b[..., 1, :]) / 2)
    torch.testing.assert_close(out[..., 2, :], a[..., 2, :])
    assert torch.equal(out[..., 3, :], torch.zeros_like(out[..., 3, :]))


def test_merge_dispatch_keeps_large_lse_exact_on_cpu():
    """The public merge (the PyTorch path on the CPU) at an LSE where float32 has no room for log 2."""
    o = torch.ones(1, 1, 3, 8)
    lse = torch.full((1, 1, 3), 1e8)
    out, _ = merge([(o, lse), (o, lse)])
    assert torch.equal(out, o)


@pytest.mark.parametrize("lse_shape, out_shape", [((1, 1, 5), (1, 2, 5, 16)), ((1, 2, 4), (1, 2, 5, 16)),
                                                  ((1, 2, 5), (1, 2, 6, 16))])
def test_merge_rejects_lse_not_matching_out(lse_shape, out_shape):
    """Every lse is its output's shape without the head dim, and every output has one shape: the
    one-pass kernel indexes them so (a broadcast lse would be read past its rows), and the PyTorch
    merge must not broadcast where the kernel cannot."""
    parts = [(torch.zeros(1, 2, 5, 16), torch.zeros(1, 2, 5)), (torch.zeros(out_shape), torch.zeros(lse_shape))]
    for fn in (merge, merge_torch):
        with pytest.raises(ValueError, match="parts"):
            fn(parts)
    if INTERPRETED:
        from pisa_attn.ops.triton import merge as kernel

        bad = [(torch.zeros(out_shape), torch.zeros(lse_shape))] * 2
        assert not kernel.supports(bad)


@pytest.mark.skipif(not INTERPRETED, reason="the Triton merge runs through the CPU interpreter here")
def test_triton_merge_needs_lse_on_the_outputs_device():
    """The kernel reads every lse through a pointer on the outputs' device: an lse elsewhere goes
    to the PyTorch merge (which raises or copies), not into the launch."""
    from pisa_attn.ops.triton import merge as kernel

    o = torch.zeros(1, 2, 5, 16)
    assert kernel.supports([(o, torch.zeros(1, 2, 5))])
    assert not kernel.supports([(o, torch.zeros(1, 2, 5, device="meta"))])
