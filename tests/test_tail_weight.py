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


class _FactoriesOnMeta(torch.overrides.TorchFunctionMode):
    """Tensors asked for on CUDA are made on the meta device (so the cache's keys can be checked
    without a GPU); the devices asked for are kept."""

    def __init__(self):
        super().__init__()
        self.devices = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        dev = kwargs.get("device")
        if dev is not None and torch.device(dev).type == "cuda":
            self.devices.append(torch.device(dev))
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


def test_a_device_without_index_is_cached_as_the_current_device(monkeypatch):
    """``"cuda"`` is the current CUDA device: one tensor with ``"cuda:0"`` while 0 is current, and
    not the tensor of device 0 once another device is current."""
    from pisa_attn import tail_weight

    current = [0]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(tail_weight, "_capturing", lambda device: False)
    values = (0.2718281828,) * 3  # values no other test caches
    with _FactoriesOnMeta() as made:
        a = tail_weight.weights(values, "cuda")
        assert tail_weight.weights(values, torch.device("cuda", 0)) is a
        current[0] = 1
        b = tail_weight.weights(values, torch.device("cuda"))
        assert b is not a and tail_weight.weights(values, "cuda:1") is b
        current[0] = 0
        assert tail_weight.weights(values, "cuda") is a
    assert made.devices == [torch.device("cuda", 0), torch.device("cuda", 1)]


def test_a_cached_weight_changed_in_place_is_not_served_again():
    """A caller that changes a returned weight in place gets its own tensor changed, never the
    values of later calls; an unchanged one is served again as it is (no copy per call)."""
    from pisa_attn import tail_weight

    values = (0.1414213562, -0.1732050808)
    w = tail_weight.weights(values, "cpu")
    assert tail_weight.weights(values, "cpu") is w
    w.mul_(2)
    again = tail_weight.weights(values, "cpu")
    assert again is not w and torch.equal(again, torch.tensor(values))
    assert tail_weight.weights(values, "cpu") is again
    ones = tail_weight.ones(3, "cpu")
    with torch.inference_mode():
        ones.zero_()
    assert torch.equal(tail_weight.ones(3, "cpu"), torch.ones(3))
    r = tail_weight.resolve(0.3141592653, mode="first", heads=2, device="cpu")
    r.add_(1)
    assert torch.equal(tail_weight.resolve(0.3141592653, mode="first", heads=2, device="cpu"),
                       torch.full((2,), 0.3141592653))
