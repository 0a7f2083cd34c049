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
