"""GPU checks of plan/run (skipped without CUDA): run equals pisa_attention bit for bit on the
kernel backends at real sizes, is within bf16 tolerance of the float64 reference under its own
selection, replays from a CUDA graph, and allocates only its output.

    PYTHONPATH=src python -m pytest tests/gpu/test_gpu_plan_run.py -q -s
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from pisa_attn import PisaSettings, pisa_attention, plan, run  # noqa: E402
from pisa_attn.ops import reference as ref  # noqa: E402
from test_gpu_kernels import KERNELS, qkv, rel_l1  # noqa: E402


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_run_equals_pisa_attention_B2_H16_L4096_D128(backend, layout):
    q, k, v = qkv(2, 16, 16, 4096, 4096, 128, torch.bfloat16, layout, seed=1)
    if layout == "bshd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    p = plan(q, k, PisaSettings(density=0.125, backend=backend, layout=layout))
    want = pisa_attention(q, k, v, density=0.125, backend=backend, layout=layout)
    out, sel = run(p, q, k, v, return_selection=True)
    assert torch.equal(out, want)
    qh, kh, vh = (x.transpose(1, 2) if layout == "bshd" else x for x in (q, k, v))
    o64, _ = ref.attend(qh.double(), kh.double(), vh.double(), ref.prepare(qh.double(), kh.double(), vh.double(), 64),
                        sel, mode="hybrid", scale=128**-0.5, block_size=64, alpha=p.alpha.double())
    got = out.transpose(1, 2) if layout == "bshd" else out
    assert rel_l1(got, o64) < 1e-2


@pytest.mark.parametrize("backend", KERNELS)
def test_run_replays_from_a_cuda_graph_B1_H8_L8192_D128(backend):
    q, k, v = qkv(1, 8, 8, 8192, 8192, 128, torch.bfloat16, "bhsd", seed=2)
    p = plan(q, k, PisaSettings(density=0.125, backend=backend))
    out = torch.empty_like(q)
    want = run(p, q, k, v)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run(p, q, k, v, out=out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    out.fill_(float("nan"))
    with torch.cuda.graph(g):
        run(p, q, k, v, out=out)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    q.copy_(torch.randn_like(q))  # new data, same buffers: the replay follows it
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, run(p, q, k, v))


@pytest.mark.parametrize("backend", KERNELS)
def test_a_planned_run_allocates_only_its_output(backend):
    q, k, v = qkv(2, 16, 16, 4096, 4096, 128, torch.bfloat16, "bhsd", seed=3)
    p = plan(q, k, PisaSettings(density=0.125, backend=backend))
    out = torch.empty_like(q)
    for _ in range(3):
        run(p, q, k, v, out=out)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    run(p, q, k, v, out=out)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before


@pytest.mark.parametrize("text", ["before", "after"])
def test_joint_call_text_queries_on_a_side_stream_B2_H8_T333_D128(text, monkeypatch):
    # The integration's joint call: text queries' exact attention on a side stream while PISA runs
    # on the caller's. 333 text tokens put the image's first query mid-block ("before": the in-place
    # PISA call also writes text rows, which must end up exact); a key-padding mask of the last 20
    # text keys on one row ("after") gives two row groups. Same bits as both on one stream, text
    # rows equal to exact attention, and the same from a CUDA graph.
    from pisa_attn.diffusers import calls
    from pisa_attn.diffusers.tiling import build_layouts

    seq = build_layouts((48, 48), 333, text, (8, 8), 64).joint
    n = seq.length
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(2, n, 8, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    s = PisaSettings(density=0.15, layout="bshd")
    lens_cases = [None] if text == "before" else [None, [n, n - 20]]
    for lens in lens_cases:
        for plans in (None, {}):
            monkeypatch.setattr(calls, "TEXT_SIDE_STREAM", False)
            want = calls.sparse_attention(q, k, v, seq, lens, s, plans=plans)
            monkeypatch.setattr(calls, "TEXT_SIDE_STREAM", True)
            got = calls.sparse_attention(q, k, v, seq, lens, s, plans=plans)
            torch.cuda.synchronize()
            assert torch.equal(got, want), (lens, plans is None)
            for row in range(2):
                nk = n if lens is None else lens[row]
                for a, b in seq.text_ranges():
                    ref32 = calls.dense_attention(*(x[row:row + 1].float() for x in (q[:, a:b], k[:, :nk], v[:, :nk])),
                                                  None, None, False)
                    # every text row exact, those the PISA call also writes included (a few rows
                    # of PISA's output would read ~1e-1 there)
                    start = seq.image_lo // 64 * 64
                    for r0, r1 in ((a, b), (max(a, start), min(b, seq.image_hi))):
                        if r1 > r0:
                            assert rel_l1(got[row:row + 1, r0:r1], ref32[:, r0 - a:r1 - a]) < 5e-3, (lens, r0, r1)
    plans = {}
    out = calls.sparse_attention(q, k, v, seq, None, s, plans=plans)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture
        calls.sparse_attention(q, k, v, seq, None, s, plans=plans)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = calls.sparse_attention(q, k, v, seq, None, s, plans=plans)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, out)


@pytest.mark.parametrize("precision", ["input", "fp8"])
@pytest.mark.parametrize("backend", KERNELS)
def test_drop_row_without_exact_blocks_is_zero_B1_H2_L1024_D128(backend, precision):
    """Keep-or-drop under a selection with an empty row: out 0 and lse -inf there, as the
    reference (no 0/0), the other rows as without it."""
    if precision != "input" and backend != "hopper":
        pytest.skip("low precision runs on the hopper backend")
    from pisa_attn.ops.selection import Selection

    q, k, v = qkv(1, 2, 2, 1024, 1024, 128, torch.bfloat16, "bhsd", seed=9)
    p = plan(q, k, PisaSettings(density=0.125, mode="drop", backend=backend, precision=precision))
    _, sel = run(p, q, k, v, return_selection=True)
    mask = sel.to_mask(p.n_kv_blocks)
    mask[:, :, 3] = False  # query block 3: no exact block at all
    empty = Selection.from_mask(mask, p.width)
    out, lse = run(p, q, k, v, selection=empty, return_lse=True)
    assert torch.isfinite(out).all()
    assert (out[:, :, 192:256] == 0).all() and torch.isneginf(lse[:, :, 192:256]).all()
    want, want_lse = run(p, q, k, v, selection=sel, return_lse=True)
    rows = torch.ones(1024, dtype=torch.bool, device=q.device)
    rows[192:256] = False
    assert torch.equal(out[:, :, rows], want[:, :, rows]) and torch.equal(lse[:, :, rows], want_lse[:, :, rows])


@pytest.mark.parametrize("precision", ["input", "int8", "fp8"])
@pytest.mark.parametrize("mode", ["hybrid", "zeroth"])
def test_row_without_exact_blocks_past_16k_keys_B1_H2_Lq1024_Lk16384_D128(mode, precision):
    """From 16K keys the exact loop starts at a bound of its scores; a row given no exact block
    (a ring shard's row) must not keep that bound as its maximum: q and k at twice unit scale put
    it far above the tail's scores, whose weights then all underflowed (0/0)."""
    from pisa_attn.ops.selection import Selection

    q, k, v = qkv(1, 2, 2, 1024, 16384, 128, torch.bfloat16, "bhsd", seed=13)
    q, k = q * 2, k * 2
    p = plan(q, k, PisaSettings(density=0.125, mode=mode, backend="hopper", precision=precision))
    _, sel = run(p, q, k, v, return_selection=True)
    mask = sel.to_mask(p.n_kv_blocks)
    mask[:, :, 2:6] = False  # query blocks 2-5: tail only
    empty = Selection.from_mask(mask, p.width)
    out, lse = run(p, q, k, v, selection=empty, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    o64, l64 = ref.attend(q.double(), k.double(), v.double(), ref.prepare(q.double(), k.double(), v.double(), 64),
                          empty, mode=mode, scale=128**-0.5, block_size=64,
                          alpha=None if p.alpha is None else p.alpha.double())
    # the low precisions against float64 PISA within their documented bounds (tests/gpu/test_gpu_fuzz.py)
    assert rel_l1(out, o64) < {"input": 1e-2, "int8": 4e-2, "fp8": 1.5e-1}[precision]
    assert (lse.double() - l64).abs().max().item() < (1e-2 if precision == "input" else 0.6)


@pytest.mark.parametrize("precision", ["input", "int8"])
@pytest.mark.parametrize("backend", KERNELS)
def test_a_plan_serves_inference_mode_and_no_grad_alike_B1_H4_L4096_D128(backend, precision):
    """A plan's workspace made under torch.inference_mode() (a pipeline call) and run later under
    no_grad, and the reverse: the same output each time."""
    if precision != "input" and backend != "hopper":
        pytest.skip("low precision runs on the hopper backend")
    q, k, v = qkv(1, 4, 4, 4096, 4096, 128, torch.bfloat16, "bhsd", seed=6)
    s = PisaSettings(density=0.125, backend=backend, precision=precision)
    for first, second in ((torch.inference_mode, torch.no_grad), (torch.no_grad, torch.inference_mode)):
        with first():
            p = plan(q, k, s)
            a = run(p, q, k, v).clone()
        with second():
            b = run(p, q, k, v)
            c = pisa_attention(q, k, v, settings=s)
        assert torch.equal(a, b) and torch.equal(a, c)
