"""The Hopper attend (three query blocks per CTA) compiled with extra ptxas options against the
default, on one selection: keep-or-drop, zeroth and hybrid, outputs compared bit for bit, 3
interleaved rounds, cuDNN SDPA in the same run; B2-H16-D128 bf16, 12.5 %, Gaussian and DiT-like.
Written for Triton 3.9's CUDA 13.4 ptxas, whose register allocation spills in the three-consumer
loops (run with that Triton first on ``PYTHONPATH``). The default is the build with no extra option
(the library's :func:`ptxas_options` is replaced in both):

    PYTHONPATH=src python3 benchmarks/ptxas_options.py --options=--register-usage-level=0
"""
import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import exact_loop as el  # noqa: E402

from pisa_attn.ops.hopper import attention as A  # noqa: E402

class Opt:
    """The kernel's launcher with ``ptx_options`` as the compile options' (and in its key); ``""``:
    none, whatever the library sets."""

    def __init__(self, inner, opt):
        self.inner, self.opt = inner, opt
    def cached(self, key, args):
        return self.inner.cached(key + (self.opt,), args)
    def __call__(self, key, grid, args, constexprs, full_args=None, **o):
        o.pop("ptx_options", None)  # the library's own choice (ptxas_options) is what is compared
        if self.opt:
            o["ptx_options"] = self.opt
        return self.inner(key + (self.opt,), grid, args, constexprs, full_args=full_args, **o)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--options", default="--register-usage-level=0", help="the extra ptxas options")
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536])
    a = ap.parse_args(argv)
    base = A._launch
    rows = []
    for L, t_cudnn, source, q, k, v, stats, sel, n_sel in el.selected_inputs(a.lengths):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        fns, outs = {}, {}
        for opt in ("", a.options):
            for mode in ("drop", "zeroth", "hybrid"):
                def f(mode=mode, opt=opt):
                    A._launch = Opt(base, opt)
                    try:
                        A.attention(q, k, v, *stats.tail(), *sel, mode=mode, scale=q.shape[-1] ** -0.5, block_size=64,
                                    n_select=n_sel, out=out, lse=lse, query_group=3, kbound=stats.kbound, kmax=stats.kmax)
                    finally:
                        A._launch = base
                key = f"{mode}-g3{'-opt' if opt else ''}"
                fns[key] = f
                f()
                outs[key] = out.clone()
        for mode in ("drop", "zeroth", "hybrid"):
            x, y = outs[f"{mode}-g3"], outs[f"{mode}-g3-opt"]
            print(L, source, mode, "same" if torch.equal(x, y) else f"differ max {(x.float() - y.float()).abs().max().item():.3g}")
        ts = el.attend_rounds(fns, t_cudnn / 6)
        med = {key: statistics.median(x) for key, x in ts.items()}
        rows.append(dict(L=L, source=source, cudnn_ms=t_cudnn, ms=med, rounds_ms=ts))
        print(f"{L} {source}: " + " ".join(f"{key} {t:.3f}" for key, t in med.items()) + " (ms)", flush=True)
    kernels = [dict(mode=key[0][4], options=key[0][-1], n_spills=getattr(e.kernel, "n_spills", None),
                    n_regs=getattr(e.kernel, "n_regs", None)) for key, e in base._cache.items()]
    print(kernels)
    with open(os.path.join(os.environ.get("OUT", "."), "ptxas_options.json"), "w") as fh:
        json.dump(dict(el.toolchain(), options=a.options, rows=rows, kernels=kernels), fh, indent=1)


if __name__ == "__main__":
    main()
