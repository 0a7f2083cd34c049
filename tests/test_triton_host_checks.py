"""Host-side code around the Triton kernels: the launcher's compiled-kernel cache and the argument
checks before a launch (CPU: kernels through Triton's interpreter, launches through fake kernels)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pisa_attn.ops import launch  # noqa: E402
from pisa_attn.ops import reference as ref  # noqa: E402
from pisa_attn.ops.selection import Selection  # noqa: E402
from pisa_attn.ops.triton import select as S  # noqa: E402
from pisa_attn.ops.triton.op import BACKEND as TRITON  # noqa: E402

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


_SENTINEL = -7  # what no kernel writes: a block index is never negative


def _padded_ws(b, h, nq, nk, width, pad=64):
    """A selection workspace whose index list is the head of a longer buffer filled with
    ``_SENTINEL``: a write past the list lands in the tail, where the test sees it (not past an
    allocation, which the interpreter would write through)."""
    ws = S.selection_workspace(b, h, nq, nk, width, DEV)
    n = b * h * nq * width
    backing = torch.full((n + pad,), _SENTINEL, dtype=torch.int32, device=DEV)
    idx = backing[:n].view(b, h, nq, width)
    return ws._replace(sel=ws.sel._replace(idx=idx)), backing[n:]


def _keep(h, nk, blocks):
    keep = torch.zeros(1, h, nk, dtype=torch.bool)
    keep[0, h - 1, blocks] = True  # the last head: its last row ends the index list
    return keep.to(DEV)


@pytest.mark.parametrize("nk", [20, 70], ids=["one-kernel", "two-kernel"])
def test_select_refuses_an_index_list_without_room_for_the_kept_blocks(nk):
    """Kept blocks are listed on top of the top-k: a ``width`` below min(Nk, n_select + kept blocks
    of a row) made the kernels write past the row (and report a count beyond the width). Refused
    by both backends, from ``n_keep_max`` without reading ``keep``, or from ``keep`` itself."""
    qmean, kmean = _means(1, 2, 1, 3, nk, 16)
    keep = _keep(2, nk, [0, 5, 9, 17])
    kw = dict(n_select=3, scale=0.3, keep=keep)
    ws, tail = _padded_ws(1, 2, 3, nk, 5)
    with pytest.raises(ValueError, match="width"):
        S.select(qmean, kmean, width=5, ws=ws, **kw)
    assert (tail == _SENTINEL).all()
    for fn in (S.select, ref.select):
        with pytest.raises(ValueError, match="width"):
            fn(qmean, kmean, width=5, **kw)
        with pytest.raises(ValueError, match="width"):
            fn(qmean, kmean, width=6, n_keep_max=4, **kw)
        for bad, err in ((-1, ValueError), (nk + 1, ValueError), (2.0, TypeError), (True, TypeError)):
            with pytest.raises(err, match="n_keep_max"):
                fn(qmean, kmean, width=nk, n_keep_max=bad, **kw)
    # room for them: the same selection whether n_keep_max is given or read from keep
    want = ref.select(qmean, kmean, width=7, **kw)
    for fn in (S.select, ref.select):
        for width, n_keep_max in ((7, None), (7, 4), (nk, nk), (nk, None)):
            got = fn(qmean, kmean, width=width, n_keep_max=n_keep_max, **kw)
            assert torch.equal(got.to_mask(nk), want.to_mask(nk)) and torch.equal(got.cnt, want.cnt)
    assert int(want.cnt.max()) == 7
    # without keep, n_keep_max is only checked
    S.select(qmean, kmean, n_select=3, width=3, scale=0.3, n_keep_max=0)


@pytest.mark.parametrize("nk", [20, 70], ids=["one-kernel", "two-kernel"])
def test_select_kernels_write_inside_the_index_list(nk, monkeypatch):
    """With the width check bypassed (a caller's wrong ``n_keep_max``), the kernels still write no
    entry past a row: each row lists its first ``width`` exact blocks, its count and bits say the
    same, and nothing lands past the list."""
    qmean, kmean = _means(1, 2, 1, 3, nk, 16)
    keep = _keep(2, nk, [0, 5, 9, 17])
    full = S.select(qmean, kmean, n_select=3, width=7, scale=0.3, keep=keep)
    monkeypatch.setattr(S, "check_select_width", lambda width, n_select, *a: None, raising=False)
    ws, tail = _padded_ws(1, 2, 3, nk, 5)
    got = S.select(qmean, kmean, n_select=3, width=5, scale=0.3, keep=keep, ws=ws)
    assert (tail == _SENTINEL).all()
    want = Selection.from_mask(full.to_mask(nk), 5)
    assert torch.equal(got.cnt, want.cnt) and torch.equal(got.bits, want.bits)
    listed = torch.arange(5, device=DEV) < want.cnt[..., None]  # entries past cnt are unspecified
    assert torch.equal(got.idx[listed], want.idx[listed])


def _attend_inputs(backend):
    g = torch.Generator().manual_seed(3)
    dtype = torch.float16 if backend == "triton" else torch.float32
    q, k, v = (torch.randn(1, 2, 100, 16, generator=g).to(dtype).to(DEV) for _ in range(3))
    be = TRITON if backend == "triton" else ref.BACKEND
    stats = be.prepare(q, k, v, 16)
    sel = Selection.from_mask(torch.rand(1, 2, 7, 7, generator=g).to(DEV) < 0.5, 4)
    return be, q, k, v, stats, sel


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_attend_refuses_a_selection_of_other_shapes(backend):
    """A Selection for other query blocks, heads or keys, of another dtype or on another device:
    the kernel indexed it by q's and k's shapes (reading past it, or other rows' blocks); the
    reference read another selection's blocks. Refused before anything runs."""
    be, q, k, v, stats, sel = _attend_inputs(backend)
    kw = dict(mode="hybrid", scale=0.25, block_size=16)
    idx, cnt, bits = sel
    bad = [
        Selection(idx.long(), cnt, bits),  # first: the old code ran it without reading past a tensor
        Selection(idx, cnt.long(), bits),
        Selection(idx, cnt, bits.long()),
        Selection(idx[:, :, :6], cnt[:, :, :6], bits[:, :, :6]),  # other query blocks
        Selection(idx[:, :1], cnt, bits),  # other heads
        Selection(idx, cnt[:, :, :6], bits),
        Selection(idx, cnt, torch.cat([bits, bits], -1)),  # other keys (more than 32 blocks)
        Selection(idx.expand(2, -1, -1, -1), cnt.expand(2, -1, -1), bits.expand(2, -1, -1, -1)),  # other batch
        Selection(idx[..., :0], cnt, bits),  # an empty index list
        Selection(*(x.to("meta") for x in sel)),  # another device
        Selection(idx, cnt.to("meta"), bits),
    ]
    for s in bad:
        with pytest.raises(ValueError, match="selection"):
            be.attend(q, k, v, stats, s, **kw)
    with pytest.raises(TypeError, match="selection"):
        be.attend(q, k, v, stats, (idx, cnt), **kw)
    out, lse = be.attend(q, k, v, stats, sel, **kw)  # the selection these shapes take
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_attend_refuses_output_buffers_it_would_write_past():
    """``out`` and ``lse`` given to a stage call: the kernel writes them by q's shape (``lse`` by
    row index), so a smaller, other-dtype, other-device or strided ``lse`` is refused by name."""
    be, q, k, v, stats, sel = _attend_inputs("triton")
    kw = dict(mode="hybrid", scale=0.25, block_size=16)
    b, h, lq, d = q.shape
    good_lse = torch.empty(b, h, lq, device=DEV)
    for out in (torch.empty(b, h, lq - 1, d, dtype=q.dtype, device=DEV), torch.empty(b, h, lq, d, dtype=torch.int32,
                device=DEV), torch.empty(b, h, lq, d, dtype=q.dtype, device="meta")):
        with pytest.raises(ValueError, match="out must be"):
            be.attend(q, k, v, stats, sel, out=out, lse=good_lse, **kw)
    good_out = torch.empty_like(q)
    for lse in (torch.empty(b, h, lq - 1, device=DEV), torch.empty(b, h, lq, dtype=torch.float16, device=DEV),
                torch.empty(b, lq, h, device=DEV).transpose(1, 2)):
        with pytest.raises(ValueError, match="lse must be"):
            be.attend(q, k, v, stats, sel, out=good_out, lse=lse, **kw)
    o, l_ = be.attend(q, k, v, stats, sel, out=good_out, lse=good_lse, **kw)
    assert o is good_out and l_ is good_lse and torch.isfinite(o).all()
    want, want_lse = be.attend(q, k, v, stats, sel, **kw)
    assert torch.equal(o, want) and torch.equal(l_, want_lse)
    # a float32 partial buffer is the kernel's to write
    o32, _ = be.attend(q, k, v, stats, sel, out=torch.empty(b, h, lq, d, device=DEV), **kw)
    assert o32.dtype == torch.float32 and (o32 - want.float()).abs().max() < 1e-2
