"""Host-side code around the Triton kernels: the launcher's compiled-kernel cache and the argument
checks before a launch (CPU: kernels through Triton's interpreter, launches through fake kernels)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pisa_attn.ops import launch  # noqa: E402
from pisa_attn.ops import reference as ref  # noqa: E402
from pisa_attn.ops.triton import select as S  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


class _Compiled:
    """What the launcher keeps of a compiled kernel (the public launch path)."""

    function = None
    packed_metadata = None
    run = None

    def __init__(self, log):
        self.log = log

    def _init_handles(self):
        pass

    def __getitem__(self, grid):
        return lambda *args, stream=None: self.log.append(("launch", args))


class _Jit:
    """A jit function whose every compile is logged."""

    def __init__(self):
        self.compiles = []
        self.log = []
        self.fn = lambda x_ptr, stride, n: None

    def __getitem__(self, grid):
        def compile_and_run(*args, **kw):
            self.compiles.append(args)
            return _Compiled(self.log)

        return compile_and_run


@pytest.fixture
def fake_jit(monkeypatch):
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(launch, "_DIRECT", False)
    return _Jit()


def test_a_kernel_loaded_on_one_device_does_not_serve_another(fake_jit):
    """A compiled kernel's function handle belongs to the device it was loaded on: a launch on
    another device (one process driving two GPUs) compiles its own."""
    lau = launch.Launcher(fake_jit)
    a, b = torch.zeros(4), torch.zeros(4, device="meta")
    lau("k", (1,), (a, 16, 3), {})
    lau("k", (1,), (b, 16, 3), {})
    assert len(fake_jit.compiles) == 2
    lau("k", (1,), (a, 16, 3), {})  # the first device's kernel is still cached
    assert len(fake_jit.compiles) == 2


@pytest.mark.parametrize("big", [2**31 + 16, -(2**31) - 16, 2**63 + 16])
def test_a_kernel_compiled_for_int32_arguments_does_not_serve_wider_ones(fake_jit, big):
    """Triton types an int argument i32, i64 or u64 by its value, and the launch of an i32 kernel
    truncates a wider value silently: a stride past 2^31 (of the same divisibility class) must
    not reuse the kernel compiled for a small one."""
    lau = launch.Launcher(fake_jit)
    x = torch.zeros(4)
    assert launch.spec_class(big) == launch.spec_class(16)  # the callers' keys do not tell them apart
    lau(("k", launch.spec_class(16)), (1,), (x, 16, 3), {})
    lau(("k", launch.spec_class(big)), (1,), (x, big, 3), {})
    assert len(fake_jit.compiles) == 2
    lau(("k", launch.spec_class(32)), (1,), (x, 32, 3), {})  # another i32 value: the cached kernel
    assert len(fake_jit.compiles) == 2


def _means(b, h, hk, nqs, nk, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    qmean = torch.randn(b, h, nqs, d, generator=g).to(DEV)
    kmean = torch.randn(b, hk, d, nk, generator=g).to(DEV).transpose(2, 3)
    return qmean, kmean


@pytest.mark.parametrize("nk", [20, 70], ids=["one-kernel", "two-kernel"])
def test_select_refuses_an_index_list_narrower_than_the_top_k(nk):
    """Every row lists min(n_select, Nk) blocks: a narrower ``width`` made the kernels write past
    each row of the index list (into the next row, past the tensor for the last) and report a
    count beyond the width, which attention then reads as indices."""
    qmean, kmean = _means(1, 2, 1, 3, nk, 16)
    with pytest.raises(ValueError, match="width"):
        S.select(qmean, kmean, n_select=6, width=3, scale=0.3)
    with pytest.raises(ValueError, match="width"):
        S.select(qmean, kmean, n_select=6, width=0, scale=0.3)
    # n_select past the block count: every block, which a width of Nk holds
    sel = S.select(qmean, kmean, n_select=nk + 5, width=nk, scale=0.3)
    assert (sel.cnt == nk).all()
    want = ref.select(qmean, kmean, n_select=4, width=4, scale=0.3)
    got = S.select(qmean, kmean, n_select=4, width=4, scale=0.3)
    assert torch.equal(got.to_mask(nk), want.to_mask(nk)) and torch.equal(got.cnt, want.cnt)


@pytest.mark.parametrize("nk", [20, 70], ids=["one-kernel", "two-kernel"])
def test_select_reads_strided_query_means_and_deviations(nk):
    """``qmean`` and ``hdev`` views with strides of their own (a slice of the heads of wider
    statistics, batch 2) select what their contiguous copies select: the kernels index both by
    their shapes alone."""
    g = torch.Generator().manual_seed(1)
    qwide, kmean = _means(2, 4, 2, 3, nk, 16, seed=1)
    hwide = torch.rand(2, 4, nk, generator=g).to(DEV) + 0.1
    qmean, hdev = qwide[:, 1:3], hwide[:, 2:3]
    kmean = kmean[:, :1]
    assert not qmean.is_contiguous() and not hdev.is_contiguous()
    kw = dict(n_select=4, width=4, scale=0.3)
    got = S.select(qmean, kmean, hdev=hdev, **kw)
    want = S.select(qmean.contiguous(), kmean.contiguous(), hdev=hdev.contiguous(), **kw)
    assert torch.equal(got.to_mask(nk), want.to_mask(nk)) and torch.equal(got.cnt, want.cnt)
    assert torch.equal(want.to_mask(nk), ref.select(qmean, kmean, hdev=hdev, **kw).to_mask(nk))
