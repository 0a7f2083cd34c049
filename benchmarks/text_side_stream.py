"""The integration's joint image call with the text queries' exact attention on the caller's stream
after PISA (``calls.TEXT_SIDE_STREAM = False``) and on a side stream beside it (the default), at
FLUX.1-dev / SD3.5-Large 1024^2, FLUX 2048^2, FLUX heads over image sizes and HunyuanVideo 720p;
cuDNN SDPA on the whole sequence in the same rounds. Eager wall ms per call (30 back-to-back calls
until the GPU is done, ``phase_table.eager_times``; 7 interleaved rounds, median; 3 calls and 5
rounds from 50K tokens),
covariance-aware and top-k selection.

    PYTHONPATH=src OUT=DIR python3 benchmarks/text_side_stream.py [CASE ...]   # DIR/text_side_stream.json
    CASE: a dit_cases key (flux-1024, sd35-1024, flux-2048, hunyuan-720p, ...) or flux-imgN (N image
    tokens, a square, FLUX heads); default: the image cases and the FLUX sweep
"""
import json
import math
import os
import sys
from dataclasses import replace

import torch
import torch.nn.functional as F
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from phase_table import eager_times  # noqa: E402
from pisa_attn.bench import dit_cases as dc
from pisa_attn.bench.kernels import warm_gpu
from pisa_attn.bench.e2e.backends import sequence
from pisa_attn.diffusers import calls
from pisa_attn.settings import PisaSettings

dev = "cuda"
warm_gpu(1.5)
res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
import triton; res["triton"] = triton.__version__
names = sys.argv[1:] or ["flux-1024", "sd35-1024", "flux-2048"] + [f"flux-img{s * s}" for s in (32, 48, 80, 96)]
base = dc.CASES["flux-1024"]
cases = [(n, replace(base, latent=(math.isqrt(int(n[8:])),) * 2) if n.startswith("flux-img") else dc.CASES[n])
         for n in names]
for key, case in cases:
    seq = sequence(case, 64).joint
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, seq.length, case.heads, case.head_dim, generator=g).to(dev, torch.bfloat16) for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    fns = {"dense": lambda: F.scaled_dot_product_attention(qt, kt, vt)}
    for cov in (True, False):
        s = PisaSettings(density=case.density, covariance_aware=cov, block_size=64, layout="bshd")
        plans = {}
        def mk(flag, s=s, plans=plans):
            def f():
                calls.TEXT_SIDE_STREAM = flag
                return calls.sparse_attention(q, k, v, seq, None, s, plans=plans)
            return f
        fns[f"cov{int(cov)}_one"] = mk(False)
        fns[f"cov{int(cov)}_side"] = mk(True)
    t = {n: [] for n in fns}
    big = seq.length >= 50_000
    for r in range(5 if big else 7):
        for n, f in fns.items():
            t[n].append(eager_times(f, 3 if big else 30)[1])
    med = {n: sorted(v_)[len(v_) // 2] for n, v_ in t.items()}
    res[key] = {"tokens": seq.length, "heads": case.heads, "text": seq.text_len, "rounds": t, "median": med}
    print(f"{key:12s} L={seq.length:6d} " + " ".join(f"{n} {m:.4f}" for n, m in med.items())
          + "  r: " + " ".join(f"{n} {med['dense']/m:.2f}" for n, m in med.items() if n != "dense"), flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "text_side_stream.json"), "w"), indent=1)
