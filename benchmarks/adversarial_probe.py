"""Adversarial inputs for the exact loop's fixed maximum (from 16K keys) and a few other edges:
the hopper and triton backends (and the low precisions on the first two) against the float64
reference under the kernel's own selection; writes ``$OUT/probe.json``.

    PYTHONPATH=src OUT=DIR python3 benchmarks/adversarial_probe.py
"""
import json, os, torch
from pisa_attn import PisaSettings, plan, run
from pisa_attn.ops import reference as ref

def rel(a, b):
    return ((a.double() - b).abs().sum() / b.abs().sum().clamp_min(1e-300)).item()

def case(name, q, k, v, backend, mode="hybrid", density=0.125, precision="input", **kw):
    try:
        p = plan(q, k, PisaSettings(density=density, mode=mode, backend=backend, precision=precision, **kw))
        out, lse, sel = run(p, q, k, v, return_lse=True, return_selection=True)
        torch.cuda.synchronize()
        q64, k64, v64 = (x.double() for x in (q, k, v))
        st = ref.prepare(q64, k64, v64, 64)
        o64, l64 = ref.attend(q64, k64, v64, st, sel, mode=mode, scale=p.scale, block_size=64,
                              alpha=None if p.alpha is None else p.alpha.double())
        fin = bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())
        r = dict(name=name, backend=backend, mode=mode, precision=precision, finite=fin, rel_l1=rel(out, o64),
                 lse_err=float((lse.double() - l64).abs().max()), ref_finite=bool(torch.isfinite(o64).all()))
    except Exception as e:  # noqa: BLE001
        r = dict(name=name, backend=backend, mode=mode, precision=precision, error=f"{type(e).__name__}: {str(e)[:200]}")
    tol = 1e-2 if precision == "input" else 4e-2
    r["ok"] = "error" not in r and r["finite"] and r["rel_l1"] < tol and r["lse_err"] < 2e-2
    print(r, flush=True)
    return r

g = torch.Generator(device="cuda").manual_seed(0)
def randn(*s):
    return torch.randn(*s, generator=g, device="cuda")
rows = []
L, H, D = 16384, 2, 128
bf = torch.bfloat16
for backend in ("hopper", "triton"):
    # 1. keys with a large common component along channel 0, queries pointing against it in every row:
    #    every score far below the per-row bound |q|.kmax
    k = randn(1, H, L, D); k[..., 0] += 30
    q = randn(1, H, L, D); q[..., 0] = -30
    v = randn(1, H, L, D)
    for mode in ("hybrid", "drop"):
        rows.append(case("against-common-key", q.to(bf), k.to(bf), v.to(bf), backend, mode))
    # 2. half the rows against, half along the common component
    q2 = q.clone(); q2[:, :, ::2, 0] = 30
    rows.append(case("mixed-rows", q2.to(bf), k.to(bf), v.to(bf), backend))
    # 3. one huge key (a sink) far above the rest, q 30x
    k3 = randn(1, H, L, D); k3[:, :, 5] *= 40
    rows.append(case("one-huge-key-q30", (30 * randn(1, H, L, D)).to(bf), k3.to(bf), randn(1, H, L, D).to(bf), backend))
    # 4. fp16 near overflow of the scores: |q|,|k| ~ 200 along a shared direction
    u = torch.nn.functional.normalize(randn(D), dim=0)
    q4 = randn(1, H, L, D) + 200 * u; k4 = randn(1, H, L, D) + 200 * u
    rows.append(case("fp16-large-aligned", q4.half(), k4.half(), randn(1, H, L, D).half(), backend))
    # 5. ragged lengths around the switch, Lq != Lk, GQA 8:2
    for lq, lk in ((16383, 16385), (4097, 32767)):
        rows.append(case(f"ragged-{lq}-{lk}-gqa", randn(1, 8, lq, D).to(bf), randn(1, 2, lk, D).to(bf),
                         randn(1, 2, lk, D).to(bf), backend))
    # 6. density 1 at 16K (every block exact) and k = 1
    rows.append(case("density-1", randn(1, H, L, D).to(bf), randn(1, H, L, D).to(bf), randn(1, H, L, D).to(bf), backend,
                     density=1.0))
    rows.append(case("k-1", randn(1, H, L, D).to(bf), randn(1, H, L, D).to(bf), randn(1, H, L, D).to(bf), backend,
                     density=1e-6))
# low precision on the adversarial inputs
for prec in ("fp8", "int8"):
    rows.append(case("against-common-key", q.to(bf), k.to(bf), v.to(bf), "hopper", precision=prec))
    rows.append(case("mixed-rows", q2.to(bf), k.to(bf), v.to(bf), "hopper", precision=prec))
bad = [r for r in rows if not r["ok"]]
print("FAILURES", len(bad))
for r in bad:
    print(r)
json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows),
          open(os.path.join(os.environ.get("OUT", "."), "probe.json"), "w"), indent=1)
