"""The Hopper attend (three query blocks per CTA) compiled with extra ptxas options against the
default, on one selection: keep-or-drop, zeroth and hybrid, outputs compared bit for bit, 3
interleaved rounds, cuDNN SDPA in the same run; B2-H16-D128 bf16, 12.5 %, Gaussian and DiT-like.
Written for Triton 3.9's CUDA 13.4 ptxas, whose register allocation spills in the three-consumer
loops (run with that Triton first on ``PYTHONPATH``):

    PYTHONPATH=src python3 benchmarks/ptxas_options.py --options=--register-usage-level=0
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import exact_loop as el  # noqa: E402

from pisa_attn.ops.hopper import attention as A  # noqa: E402

class Opt:
    """The kernel's launcher with ``ptx_options`` added to the compile options (and to its key)."""

    def __init__(self, inner, opt):
        self.inner, self.opt = inner, opt
    def cached(self, key, args):
        return self.inner.cached(key + (self.opt,), args)
    def __call__(self, key, grid, args, constexprs, full_args=None, **o):
        if self.opt:
            o["ptx_options"] = self.opt
        return self.inner(key + (self.opt,), grid, args, constexprs, full_args=full_args, **o)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--options", default="--register-usage-level=0", help="the extra ptxas options")
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536])
    a = ap.parse_args(argv)
    base = A._launch
    OPTS = ("", a.options)
    rows = []
    for L in a.lengths:
        t_cudnn = el.cudnn_ms(L)
        for source in ("random", "dit"):
            q, k, v = el.qkv(source, L)
            stats, sel, n_sel = el.selection(q, k, v, 0.125)
            out = torch.empty_like(q)
            lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
            fns = {}
            for opt in OPTS:
                for mode in ("drop", "zeroth", "hybrid"):
                    def f(mode=mode, opt=opt):
                        A._launch = Opt(base, opt)
                        try:
                            A.attention(q, k, v, *stats.tail(), *sel, mode=mode, scale=q.shape[-1] ** -0.5, block_size=64,
                                        n_select=n_sel, out=out, lse=lse, query_group=3, kbound=stats.kbound, kmax=stats.kmax)
                        finally:
                            A._launch = base
                    fns[f"{mode}-g3{'-opt' if opt else ''}"] = f
            ref = {}
            for key, f in fns.items():
                f()
                torch.cuda.synchronize()
                ref[key] = out.clone()
            for mode in ("drop", "zeroth", "hybrid"):
                x, y = ref[f"{mode}-g3"], ref[f"{mode}-g3-opt"]
                print(L, source, mode, "same" if torch.equal(x, y) else f"differ max {(x.float() - y.float()).abs().max().item():.3g}")
            ts = {key: [] for key in fns}
            for _ in range(3):
                for key, f in fns.items():
                    ts[key].append(el.ms(f, est_ms=t_cudnn / 6))
            med = {key: sorted(x)[1] for key, x in ts.items()}
            rows.append(dict(L=L, source=source, cudnn_ms=t_cudnn, ms=med, rounds_ms=ts))
            print(f"{L} {source}: " + " ".join(f"{key} {t:.3f}" for key, t in med.items()) + " (ms)", flush=True)
    spills = []
    for key, e in base._cache.items():
        kern = e.kernel
        spills.append(dict(nc=key[0][12] if len(key[0]) > 12 else None, mode=key[0][4], opt=key[0][-1] if isinstance(key[0][-1], str) else "",
                           n_spills=getattr(kern, "n_spills", None), n_regs=getattr(kern, "n_regs", None),
                           ptx_options=getattr(kern.metadata, "ptx_options", None)))
    print(spills)
    with open(os.path.join(os.environ.get("OUT", "."), "ptxas_options.json"), "w") as fh:
        json.dump(dict(el.toolchain(), options=a.options, rows=rows, kernels=spills), fh, indent=1)


if __name__ == "__main__":
    main()
