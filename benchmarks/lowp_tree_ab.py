"""One source tree's low-precision whole calls, for comparing two trees (this one and an earlier
commit's) across processes: output bits (md5) and time.

    git archive REV src | tar -x -C DIR
    for t in DIR . DIR .; do PYTHONPATH= OUT=out python3 benchmarks/lowp_tree_ab.py $t TAG; done

Per precision (``int8``, ``fp8``, ``int8-fp8``) and length (4K, 32K): the hybrid call (plan/run,
backend ``hopper``, B2-H16-D128 bf16 Gaussian, 12.5 %, the default covariance-aware selection),
the md5 of its output and the median of three ``do_bench`` medians. Writes ``$OUT/lowp_TAG.json``.
The trees' outputs must be the same bits where a change is meant to keep them.
"""

import hashlib
import json
import os
import sys

root, tag = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.join(os.path.abspath(root), "src"))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import pisa_attn  # noqa: E402
from pisa_attn import PisaSettings, plan, run  # noqa: E402

if not pisa_attn.__file__.startswith(os.path.abspath(root)):
    raise SystemExit(f"pisa_attn came from {pisa_attn.__file__}, not from {root}")
res = {}
for L in (4096, 32768):
    g = torch.Generator(device="cuda").manual_seed(L)
    q, k, v = (torch.randn(2, 16, L, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    for prec in ("int8", "fp8", "int8-fp8"):
        p = plan(q, k, PisaSettings(density=0.125, mode="hybrid", backend="hopper", precision=prec))
        o = torch.empty_like(q)

        def fn():
            run(p, q, k, v, out=o)

        fn()
        torch.cuda.synchronize()
        h = hashlib.md5(o.view(torch.int16).cpu().numpy().tobytes()).hexdigest()
        t = sorted(do_bench(fn, warmup=10, rep=50, return_mode="median") for _ in range(3))[1]
        res[f"{prec}-{L}"] = {"md5": h, "ms": t}
        print(tag, prec, L, h, round(t, 4), flush=True)
with open(os.path.join(os.environ.get("OUT", "."), f"lowp_{tag}.json"), "w") as f:
    json.dump(res, f, indent=1)
