"""Whether the working tree's statistics kernels give the same bits as an earlier ``prepare.py``
(loaded as a module of ``pisa_attn.ops.triton``) on the GPU: every statistic and every
low-precision copy, bf16 and fp16, whole and ragged lengths, with and without the covariance term.

    PYTHONPATH=src python3 benchmarks/prepare_same.py --baseline OLD/prepare.py

Prints one line per case (``identical``, or each field's rel-L1 / share of differing bytes) and
exits 1 if a statistic differs by more than 1e-3 rel-L1 or more than 0.1 % of a copy's bytes differ.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import torch

from pisa_attn.ops.triton import prepare as P

STATS = ("qmean", "kmean", "kbar", "kscale", "vbar", "hbar", "hbar_lp", "hscale", "hdev", "kbound")
COPIES = ("mu", "k8", "sigma", "v8t", "tau", "vcs")


def load(path: str):
    spec = importlib.util.spec_from_file_location("pisa_attn.ops.triton._base_prepare", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="an earlier prepare.py")
    ap.add_argument("--lengths", nargs="+", type=int, default=[4096, 4000, 8229])
    a = ap.parse_args()
    base = load(a.baseline)
    torch.manual_seed(0)
    bad = 0
    for dt in (torch.bfloat16, torch.float16):
        for L in a.lengths:
            for quant in (None, "fp8", "int8-fp8", "int8"):
                for hdev in (False, True):
                    q, k, v = (torch.randn(2, 4, L, 128, device="cuda", dtype=dt) * s for s in (1, 3, 2))
                    k = k + 5.0  # a common component the centring must remove
                    new = P.prepare(q, k, v, 64, with_hdev=hdev, quant=quant)
                    old = base.prepare(q, k, v, 64, with_hdev=hdev, quant=quant)
                    msg = []
                    for f in STATS:
                        x, y = getattr(new, f), getattr(old, f)
                        if x is None:
                            continue
                        d = ((x.double() - y.double()).abs().sum() / y.double().abs().sum().clamp_min(1e-30)).item()
                        if d > 0:
                            msg.append(f"{f} {d:.1e}")
                        if d > 1e-3 or not torch.isfinite(x).all():
                            bad += 1
                            msg.append("BAD")
                    for f in COPIES if quant else ():
                        x, y = getattr(new.quant, f), getattr(old.quant, f)
                        if x.numel() == 0:
                            continue
                        share = (_bytes(x) != _bytes(y)).float().mean().item()
                        if share > 0:
                            msg.append(f"{f} differs in {share:.1e}")
                        if share > 1e-3:
                            bad += 1
                            msg.append("BAD")
                    print(f"{str(dt)[6:]} L{L} {quant} hdev={hdev}: " + (", ".join(msg) or "identical"), flush=True)
    print(f"{bad} case(s) beyond the bounds")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
