"""The [H] first-order weight tensors of pisa_attn.tail_weight and their cache."""

from __future__ import annotations

import torch

from pisa_attn import pisa_attention


def test_a_weight_first_made_in_inference_mode_serves_autograd_later():
    """The cache outlives the mode a tensor was made in: a weight first asked for under
    ``torch.inference_mode`` (a pipeline's sampling loop) must still be usable where autograd
    saves it for backward (a later differentiated reference call with the same weight)."""
    alpha = 0.6180339887  # a value no other test caches
    q = torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        pisa_attention(q, q, q, block_size=16, backend="reference", alpha=alpha)
    qg = q.clone().requires_grad_(True)
    out = pisa_attention(qg, qg, qg, block_size=16, backend="reference", alpha=alpha)
    out.sum().backward()
    assert qg.grad is not None and bool(torch.isfinite(qg.grad).all())
