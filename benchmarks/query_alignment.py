"""Image queries cut at the first image token vs on the key blocks' grid (CPU, under a minute).

A ``[text][image]`` model whose text length is not a multiple of the block size (77 CLIP tokens
before a FLUX 1360x768 grid of 48x85 tokens): the diffusers backend tiles the image tokens so whole
8x8 tiles sit on block boundaries of the joint sequence. Running PISA on ``q[lo:hi]`` (``lo`` = 77)
makes every 64-row query block straddle two tiles; running it on ``q[block_floor(lo):hi]`` makes
query blocks the tiles the key blocks are. Prints rel-L1 vs dense of the image queries per mode.

    python benchmarks/query_alignment.py [--heads 8] [--density 0.125] [--seed 0]
"""

from __future__ import annotations

import argparse

import torch

from pisa_attn import pisa_attention
from pisa_attn.data import dit_qkv
from pisa_attn.layout import block_floor, make_layout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--density", type=float, default=0.125)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text", type=int, default=77)
    args = ap.parse_args()
    grid, bs = (48, 85), 64
    g = dit_qkv(grid, heads=args.heads, text_tokens=args.text, tiled=False, seed=args.seed)
    joint = make_layout(grid, tile=(8, 8), text_before=args.text, order="compact_inplace")  # the backend's layout
    q, k, v = (joint.to_tiled(x, 2) for x in (g.q, g.k, g.v))
    keep = joint.keep_blocks(bs)
    lo, hi = args.text, joint.num_tokens
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v)[:, :, lo:hi].double()
    print(f"grid {grid}, {args.text} text tokens before, density {args.density}, {args.heads} heads: "
          f"rel-L1 of the image queries")
    print(f"{'mode':8s} {'cut at lo':>10s} {'block grid':>11s}")
    for mode in ("drop", "zeroth", "hybrid"):
        kw = dict(density=args.density, block_size=bs, mode=mode, keep_blocks=keep)
        cut = pisa_attention(q[:, :, lo:hi], k, v, **kw).double()
        start = block_floor(lo, bs)
        aligned = pisa_attention(q[:, :, start:hi], k, v, **kw)[:, :, lo - start :].double()
        err = [float((o - dense).abs().sum() / dense.abs().sum()) for o in (cut, aligned)]
        print(f"{mode:8s} {err[0]:10.4f} {err[1]:11.4f}")


if __name__ == "__main__":
    main()
