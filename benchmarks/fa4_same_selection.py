"""FlashAttention-4's block-sparse forward and pisa-attn's Hopper attend on ONE selection, cuDNN SDPA in
the same run.

For each length and input (Gaussian q/k/v and the DiT-like generator; B2-H16-D128 bf16, density 12.5 %)
the paper's top-k selection is computed once by pisa-attn's select stage and handed to both kernels:

* ``fa4_bs64x64``: FA4 (``flash_attn.cute``) with 64 x 64 sparse blocks, the selection as its "full"
  block list (the form its SM90 path compiles), on ``[B, L, H, D]`` copies of q/k/v;
* ``pisa_drop`` / ``pisa_hybrid``: pisa-attn's Hopper attend kernel alone (pair stream included) in
  keep-or-drop and hybrid mode, on ``[B, H, L, D]``;
* ``pisa_call``: the whole default hybrid call (``plan``/``run``: statistics, selection, attend);
* ``cudnn``: dense SDPA with the cuDNN backend.

The four are timed in 3 interleaved rounds (median).

FA4 and pisa keep-or-drop compute the same exact attention over the same blocks, so their outputs are
compared (rel-L1 on every row). ``share`` is the share of cuDNN's throughput on the computed blocks
(``computed fraction · t_cuDNN / t``). FA4 comes from a ``pip install --target`` folder (``--site``,
see ``../shared/tools/side_by_side.py`` for carrying its wheels); its ``.pth`` files are run here.

    PYTHONPATH=src python3 benchmarks/fa4_same_selection.py --site /tmp/site --out $OUT/fa4_same_selection.json
"""

from __future__ import annotations

import argparse
import json
import os
import site
import statistics
import sys

import torch

from exact_loop import B, D, H, cudnn_ms, ms, qkv  # the same inputs, baseline and timer as the exact-loop benchmark


def add_site(path: str | None) -> None:
    """A ``--target`` install is not a site dir: run its ``.pth`` files (nvidia-cutlass-dsl puts its
    ``dsl_packages`` on ``sys.path`` from one)."""
    if path:
        site.addsitedir(path)
    for d in list(sys.path):
        pk = os.path.join(d, "nvidia_cutlass_dsl", "dsl_packages")
        if os.path.isdir(pk) and pk not in sys.path:
            sys.path.insert(0, pk)


def rel_l1(a, b) -> float:
    return ((a.float() - b.float()).abs().sum() / b.float().abs().sum()).item()


def bench(L: int, source: str, density: float, t_cudnn: float, rounds: int = 3) -> dict:
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    from flash_attn.cute.interface import _flash_attn_fwd

    from pisa_attn import PisaSettings, plan, run, spec
    from pisa_attn.attention import get_backend
    from pisa_attn.ops.hopper import attention as gattn

    q, k, v = qkv(source, L)
    scale = D ** -0.5
    be = get_backend("hopper")
    stats = be.prepare(q, k, v, 64)
    nk = stats.kbar.shape[2]
    n_sel = spec.num_selected(density, nk)
    sel = be.select(stats.qmean, stats.kmean, n_select=n_sel, width=spec.selection_width(nk, n_sel, 0), scale=scale)
    if not bool((sel.cnt == n_sel).all()):
        raise RuntimeError("top-k selection with uneven counts: FA4's list needs one count per row here")
    idx = sel.idx[..., :n_sel].sort(dim=-1).values.to(torch.int32).contiguous()
    nq = idx.shape[2]
    frac = n_sel / nk
    row = dict(L=L, source=source, density=density, n_select=n_sel, computed_fraction=frac, cudnn_ms=t_cudnn)
    est = t_cudnn * frac

    # FA4 on the same blocks, "full" list (no mask_mod); [B, L, H, D] copies.
    qf, kf, vf = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    zc = torch.zeros((B, H, nq), dtype=torch.int32, device="cuda")
    zi = torch.zeros((B, H, nq, 1), dtype=torch.int32, device="cuda")
    cnt = torch.full((B, H, nq), n_sel, dtype=torch.int32, device="cuda")
    bst = BlockSparseTensorsTorch(mask_block_cnt=zc, mask_block_idx=zi, full_block_cnt=cnt, full_block_idx=idx,
                                  block_size=(64, 64))
    of = torch.empty_like(qf)
    lf = torch.empty((B, H, L), device="cuda", dtype=torch.float32)

    def fa4():
        _flash_attn_fwd(qf, kf, vf, softmax_scale=scale, block_sparse_tensors=bst, return_lse=True, out=of, lse=lf)

    fa4()
    torch.cuda.synchronize()
    fns = {"fa4_bs64x64": fa4}

    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
    for mode in ("drop", "hybrid"):
        fn = (lambda m=mode: gattn.attention(q, k, v, *stats.tail(), *sel, mode=m, scale=scale, block_size=64,
                                             n_select=n_sel, out=out, lse=lse, kbound=stats.kbound,
                                             kmax=stats.kmax))
        fn()
        torch.cuda.synchronize()
        if mode == "drop":
            row["rel_l1_fa4_vs_pisa_drop"] = rel_l1(of.transpose(1, 2), out)
            row["lse_max_abs_diff"] = (lf - lse).abs().max().item()
        fns[f"pisa_{mode}"] = fn
    p = plan(q, k, PisaSettings(density=density, backend="hopper"))
    call_out = torch.empty_like(q)
    run(p, q, k, v, out=call_out)
    torch.cuda.synchronize()
    fns["pisa_call"] = lambda: run(p, q, k, v, out=call_out)
    # interleaved rounds, median: a length's first timing reads slow on a GPU that sat idle while
    # the kernels compiled
    ts = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            ts[name].append(ms(fn, est))
    for name, t in ts.items():
        row[f"{name}_ms"] = statistics.median(t)
    row["rounds"] = ts
    for name in ("fa4_bs64x64", "pisa_drop"):
        row[f"{name}_share"] = frac * t_cudnn / row[f"{name}_ms"]
    for name in ("fa4_bs64x64", "pisa_drop", "pisa_hybrid", "pisa_call"):
        row[f"{name}_speedup"] = t_cudnn / row[f"{name}_ms"]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="*", default=[4096, 8192, 32768, 65536])
    ap.add_argument("--sources", nargs="+", default=["random", "dit"])
    ap.add_argument("--density", type=float, default=0.125)
    ap.add_argument("--site", default=None, help="pip --target folder holding flash-attn-4 and its dependencies")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "fa4_same_selection.json"))
    a = ap.parse_args()
    add_site(a.site)
    from importlib.metadata import version

    from exact_loop import toolchain  # the card and toolchain header of every result file

    res = dict(toolchain(cudnn=False),
               cudnn=torch.backends.cudnn.version(), flash_attn=version("flash-attn-4"),
               cutlass_dsl=version("nvidia-cutlass-dsl"),
               B=B, H=H, D=D, rows=[])
    for L in a.lengths:
        t_cudnn = cudnn_ms(L)
        for source in a.sources:
            try:
                row = bench(L, source, a.density, t_cudnn)
            except Exception as e:  # one failing case costs one row, not the run
                row = dict(L=L, source=source, error=f"{type(e).__name__}: {e}"[:300])
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"\n{res['device']}, torch {res['torch']}, triton {res['triton']}, flash-attn {res['flash_attn']}")
    print(f"{'L':>6} {'input':>7} {'cuDNN':>8} {'FA4 64x64':>15} {'pisa drop':>15} {'pisa hybrid':>12} "
          f"{'pisa call':>12} {'FA4-pisa rL1':>12}")
    for r in res["rows"]:
        if "error" in r:
            print(f"{r['L']:>6} {r['source']:>7} ERROR {r['error'][:80]}")
            continue
        print(f"{r['L']:>6} {r['source']:>7} {r['cudnn_ms']:>8.3f} "
              f"{r['fa4_bs64x64_ms']:>7.3f} ({r['fa4_bs64x64_share']:.2f}) {r['pisa_drop_ms']:>7.3f} ({r['pisa_drop_share']:.2f}) "
              f"{r['pisa_hybrid_ms']:>7.3f} {r['pisa_hybrid_speedup']:>3.1f}x {r['pisa_call_ms']:>7.3f} {r['pisa_call_speedup']:>3.1f}x "
              f"{r['rel_l1_fa4_vs_pisa_drop']:>12.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
