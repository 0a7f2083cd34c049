"""How many K/V tile loads a thread-block cluster with TMA multicast could save on PISA's
selections: the exact loop's L2 -> SM traffic per block computed when groups of 2, 4 or 8
adjacent query blocks load the union of their exact blocks once (2: the pair kernel's CTA today;
4: a two-CTA cluster of pairs; 8: a four-CTA cluster), on the CPU (selection only, no kernel).

``loads/computed`` = Σ_groups |∪ exact sets| / Σ_blocks |exact set|: 1 means every computed block
loads its own tile, 1/G the most a group of G can share. The exact-loop benchmark measured the
pair kernel's share of cuDNN's throughput against this quantity for G = 2; this script bounds
what a cluster would remove. Inputs: Gaussian q/k/v and the DiT-like generator at the exact-loop
benchmark's shapes (B1, H16 instead of B2: batches select alike), the paper's top-k selection at
12.5 %; the DINOv2 layers of ``--dino``.

    PYTHONPATH=src python benchmarks/cluster_sharing.py --out benchmarks/results/cluster_sharing.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from pisa_attn import data, spec
from pisa_attn.ops import reference as ref

H, D = 16, 128
GROUPS = (2, 4, 8)
DIT_GRIDS = {4096: (1, 64, 64), 8192: (2, 64, 64), 16384: (4, 64, 64), 32768: (8, 64, 64), 65536: (16, 64, 64)}
DINO = "/work/shared/data/dinov2_vits14_astronaut_l0_5_11.safetensors"


def exact_mask(q, k, density: float) -> torch.Tensor:
    """The paper's top-k selection (pooled scores, no covariance term) as a bool [B, H, Nq, Nk]."""
    st = ref.block_stats(k, k[..., :1], 64)  # the values do not enter top-k: one channel stands in
    qmean = ref.block_means(q, 64, st.kmean.dtype)
    nk = st.kmean.shape[2]
    sel = ref.select(qmean, st.kmean, n_select=spec.num_selected(density, nk), scale=q.shape[-1] ** -0.5)
    return sel.to_mask(nk)


def sharing(mask: torch.Tensor, groups=GROUPS) -> dict:
    """loads/computed per group size (adjacent query blocks), and the mean pair overlap."""
    b, h, nq, nk = mask.shape
    computed = mask.sum().item()
    out = {}
    for g in groups:
        pad = (-nq) % g
        m = torch.cat([mask, mask.new_zeros(b, h, pad, nk)], 2).view(b, h, -1, g, nk)
        out[f"loads_per_computed_g{g}"] = m.any(3).sum().item() / computed
    a, c = mask[:, :, 0 : nq - nq % 2 : 2], mask[:, :, 1::2][:, :, : nq // 2]
    shared = (a & c).sum(-1).float()
    out["pair_overlap"] = torch.cat([shared / a.sum(-1).clamp_min(1), shared / c.sum(-1).clamp_min(1)]).mean().item()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", nargs="+", type=int, default=[4096, 32768])
    ap.add_argument("--density", type=float, default=0.125)
    ap.add_argument("--dino", default=DINO)
    ap.add_argument("--groups", nargs="+", type=int, default=list(GROUPS),
                    help="query blocks sharing one load (3: the kernel's three per CTA; 6, 12: clusters of 2, 4 CTAs)")
    args = ap.parse_args()
    groups = tuple(args.groups)
    torch.set_num_threads(os.cpu_count() or 1)
    rows = []

    def report(source, L, mask):
        r = dict(source=source, L=L, density=args.density, **sharing(mask, groups))
        rows.append(r)
        print(f"{source:16s} L={L:6d} overlap {r['pair_overlap']:.3f} | loads/computed " + " ".join(
            f"G{g} {r[f'loads_per_computed_g{g}']:.3f}" for g in groups), flush=True)

    for L in args.lengths:
        g = torch.Generator().manual_seed(L)
        q, k = (torch.randn(1, H, L, D, generator=g).bfloat16().float() for _ in range(2))
        report("random", L, exact_mask(q, k, args.density))
        d = data.dit_qkv(DIT_GRIDS[L], heads=H, head_dim=D, batch=1, seed=L, dtype=torch.bfloat16)
        report("dit", L, exact_mask(d.q.float(), d.k.float(), args.density))
        del q, k, d
    if args.dino and os.path.exists(args.dino):
        from pisa_attn.qkv_file import read_qkv_file

        for e in read_qkv_file(args.dino).entries:
            report(f"dinov2-{e.name.split('.')[-1]}", e.q.shape[2], exact_mask(e.q.float(), e.k.float(), args.density))
    with open(args.out, "w") as f:
        json.dump({"note": __doc__.split("\n\n")[0].replace("\n", " "), "torch": torch.__version__, "groups": groups,
                   "rows": rows},
                  f, indent=1)
    print("\n| input | L | pair overlap | " + " | ".join(f"loads/computed G{g}" for g in groups) + " |")
    print("|---|---|---|" + "---|" * len(groups))
    for r in rows:
        print(f"| {r['source']} | {r['L']} | {r['pair_overlap']:.2f} | " + " | ".join(
            f"{r[f'loads_per_computed_g{g}']:.3f}" for g in groups) + " |")


if __name__ == "__main__":
    main()
