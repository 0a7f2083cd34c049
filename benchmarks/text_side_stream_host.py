"""The joint call's host time with the text queries on one stream or on the side stream, beside its
wall time (CUDA events; ``phase_table.eager_times``) and host time while queueing (30 calls back to
back, median of 5 interleaved rounds, covariance-aware): whether the side stream's extra host time
makes a call host-bound.

    PYTHONPATH=src python3 benchmarks/text_side_stream_host.py flux-1024 flux-9728 flux-2048 sd35-1024
    (flux-9728: FLUX heads, a 96^2 image and 512 text tokens)
"""
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from dataclasses import replace  # noqa: E402
from phase_table import eager_times  # noqa: E402
from pisa_attn.bench import dit_cases as dc
from pisa_attn.bench.kernels import warm_gpu
from pisa_attn.bench.e2e.backends import sequence
from pisa_attn.diffusers import calls
from pisa_attn.settings import PisaSettings
def ev(fn, n):
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn(); torch.cuda.synchronize(); st.record()
    for _ in range(n): fn()
    en.record(); torch.cuda.synchronize(); return st.elapsed_time(en) / n
warm_gpu(1.5)
for key in sys.argv[1:]:
    case = replace(dc.CASES["flux-1024"], latent=(96, 96)) if key == "flux-9728" else dc.CASES[key]; seq = sequence(case, 64).joint
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, seq.length, case.heads, case.head_dim, generator=g).to("cuda", torch.bfloat16) for _ in range(3))
    s = PisaSettings(density=case.density, covariance_aware=True, layout="bshd"); plans = {}
    def mk(flag):
        def f():
            calls.TEXT_SIDE_STREAM = flag
            return calls.sparse_attention(q, k, v, seq, None, s, plans=plans)
        return f
    fs = {"one": mk(False), "side": mk(True)}
    r = {f"{n}_{m}": [] for n in fs for m in ("ev", "wall", "host")}
    for _ in range(5):
        for n, f in fs.items():
            h_us, wall_ms = eager_times(f, 30)
            r[f"{n}_ev"].append(ev(f, 30)); r[f"{n}_wall"].append(wall_ms); r[f"{n}_host"].append(h_us / 1e3)
    print(key, " ".join(f"{n} {sorted(x)[2]:.4f}" for n, x in r.items()), flush=True)
