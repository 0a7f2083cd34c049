"""Selection's launch tunables, A/B in one process: the score GEMM's tile (``SCORES_TILE``) and the
top-k programs' warps and bits per search step (``TOPK_WARPS``) of the two-kernel path, on the
statistics of B2-H16-D128 bf16 Gaussian q/k/v at 12.5 %, covariance-aware, into a workspace as a
planned call runs it; every variant's selection is checked equal to the default's.

    PYTHONPATH=src OUT=DIR python3 benchmarks/select_tuning.py   # writes DIR/select_tuning.json
"""

import json
import os

import torch

from pisa_attn.bench.kernels import bench_ms
from pisa_attn.ops.triton import prepare as P
from pisa_attn.ops.triton import select as S

print(torch.cuda.get_device_name(), torch.__version__)
TILES = [(64, 64, 4), (128, 64, 4), (64, 128, 4), (128, 128, 8), (128, 64, 8), (64, 256, 8)]
TOPK = [(1, 128), (2, 128), (1, 2048), (4, 128)]
DEF_TILE, DEF_TOPK = dict(S.SCORES_TILE), dict(S.TOPK_WARPS)
res = []
for L in (16384, 32768, 65536):
    g = torch.Generator(device="cuda").manual_seed(L)
    q, k, v = (torch.randn(2, 16, L, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    st = P.prepare(q, k, v, 64, with_hdev=True)
    nk = L // 64
    n_sel = nk // 8
    ws = S.selection_workspace(2, 16, nk, nk, n_sel, q.device, scratch_elems=(4 * q.numel() * 2) // 400)

    def run():
        return S.select(st.qmean, st.kmean, n_select=n_sel, width=n_sel, scale=128 ** -0.5, hdev=st.hdev,
                        scratch_elems=(4 * q.numel() * 2) // 400, ws=ws)

    ref = [t.clone() for t in run()]
    line = []
    for rnd in range(2):
        for tile in TILES:
            for tk in TOPK:
                S.SCORES_TILE.update(bm=tile[0], bn=tile[1], warps=tile[2])
                S.TOPK_WARPS.update(warps=tk[0], two_bit_max_nkp=tk[1])
                try:
                    same = all(torch.equal(a, b) for a, b in zip(run(), ref))
                    t = bench_ms(run)
                except Exception as e:  # a tile that does not build is reported, not fatal
                    line.append(f"{tile}{tk} {type(e).__name__}")
                    continue
                res.append(dict(L=L, round=rnd, tile=tile, topk=tk, ms=t, same=same))
                line.append(f"{tile}{tk} {t:.3f}{'' if same else ' DIFF'}")
    S.SCORES_TILE.update(DEF_TILE)
    S.TOPK_WARPS.update(DEF_TOPK)
    print(L, "\n  ".join(line), flush=True)
    del q, k, v, st, ws
    torch.cuda.empty_cache()
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "select_tuning.json"), "w"), indent=1)
