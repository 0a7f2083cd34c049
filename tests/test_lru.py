"""The bounded caches: plans (with their workspaces) and token layouts keep the recent shapes only."""

import pytest
import torch

from pisa_attn import attention, pisa_attention
from pisa_attn.lru import LRU


def test_lru_drops_the_least_recently_used():
    c = LRU(2)
    c["a"], c["b"] = 1, 2
    assert c.get("a") == 1  # "a" is now the recent one
    c["c"] = 3
    assert list(c) == ["a", "c"] and c.get("b") is None and c.get("b", 0) == 0
    c["a"] = 4  # setting an entry again marks it recent too
    c["d"] = 5
    assert dict(c) == {"a": 4, "d": 5}


@pytest.mark.parametrize("limit", [0, -1, 1.5, True, "2"])
def test_lru_limit_is_checked(limit):
    with pytest.raises(ValueError, match="limit"):
        LRU(limit)


def test_pisa_attention_keeps_the_recent_shapes_plans(monkeypatch):
    """A process that meets more shapes than the cache holds keeps the most recent plans (each with
    its workspace), not all of them, and not none: a shape in use is not dropped by a new one."""
    monkeypatch.setattr(attention._PLANS, "limit", 2)
    attention.clear_plans()
    g = torch.Generator().manual_seed(0)

    def call(n):
        q, k, v = (torch.randn(1, 2, n, 16, generator=g) for _ in range(3))
        return pisa_attention(q, k, v, density=0.5, block_size=16, backend="reference")

    try:
        call(32)
        call(48)
        first = next(iter(attention._PLANS.values()))
        call(32)  # in use again: the recent one
        call(64)  # drops the 48-token plan
        lens = sorted(p.q_len for p in attention._PLANS.values())
        assert lens == [32, 64]
        assert any(p is first for p in attention._PLANS.values())  # the same plan object, not a new one
    finally:
        attention.clear_plans()


def test_managed_transformer_keeps_the_recent_layouts(monkeypatch):
    """Each resolution's token layouts are kept per managed transformer, the recent ones only: a
    dropped one is built again, with the same result, when its resolution comes back."""
    pytest.importorskip("diffusers")
    from diffusers_tiny import forward_inputs, tiny_transformer

    import pisa_attn.diffusers as pd
    from pisa_attn.diffusers import state as st

    monkeypatch.setattr(st, "LAYOUT_LIMIT", 1)
    tr, inputs = tiny_transformer("wan"), forward_inputs("wan")
    b, c, f, h, w = inputs["hidden_states"].shape
    longer = dict(inputs, hidden_states=torch.randn(b, c, f + 1, h, w, generator=torch.Generator().manual_seed(1)))
    with torch.no_grad():
        pd.apply_pisa(tr, density=0.5, block_size=16, min_kv_len=0, dense_layers=0, dense_steps=0)
        state = pd.pisa_state(tr)
        first = tr(**inputs).sample
        (grid,) = [g for g, _ in state.layouts]
        tr(**longer)
        (other,) = [g for g, _ in state.layouts]
        assert other != grid and len(state.layouts) == 1
        torch.testing.assert_close(tr(**inputs).sample, first, rtol=0, atol=0)
        assert [g for g, _ in state.layouts] == [grid]
    pd.remove_pisa(tr)
