"""The top-k programs at the key-block counts of video models (a padded row of 2048), A/B in one
process: how many of a row's scores one thread holds (``TOPK_WARPS["keys_per_thread"]``: 32 puts
a 2048-wide row on two warps, 64 on one), on the statistics of random bf16 q/k/v at 12.5 %,
covariance-aware (the default), into a workspace as a planned call runs it; every variant's
selection is checked equal to the default's. Shapes: Wan2.1-14B 720p (B1-H40-L75600),
HunyuanVideo 720p (B1-H24-L119056), B2-H16 at 64K and B1-H16 at 128K.

    PYTHONPATH=src OUT=DIR python3 benchmarks/select_wide.py   # writes DIR/select_wide.json
"""

import json
import os

import torch

from pisa_attn.bench.kernels import bench_ms
from pisa_attn.ops.triton import prepare as P
from pisa_attn.ops.triton import select as S

SHAPES = {"wan14b-720p": (1, 40, 75600), "hunyuan-720p": (1, 24, 119056), "64K": (2, 16, 65536),
          "128K": (1, 16, 131072)}
KPT = (32, 64, 16)
print(torch.cuda.get_device_name(), torch.__version__, flush=True)
default = dict(S.TOPK_WARPS)
res = []
for name, (b, h, L) in SHAPES.items():
    g = torch.Generator(device="cuda").manual_seed(L)
    q, k, v = (torch.randn(b, h, L, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    st = P.prepare(q, k, v, 64, with_hdev=True)
    del q, k, v
    nk = st.kmean.shape[2]
    n_sel = -(-nk // 8)
    scratch = b * h * nk * nk  # one chunk
    ws = S.selection_workspace(b, h, nk, nk, n_sel, st.kmean.device, scratch_elems=scratch)

    def run():
        return S.select(st.qmean, st.kmean, n_select=n_sel, width=n_sel, scale=128 ** -0.5, hdev=st.hdev,
                        scratch_elems=scratch, ws=ws)

    ref = [t.clone() for t in run()]
    times = {kpt: [] for kpt in KPT}
    same = {}
    for _ in range(3):
        for kpt in KPT:
            S.TOPK_WARPS.update(keys_per_thread=kpt)
            same[kpt] = all(torch.equal(a, b_) for a, b_ in zip(run(), ref))
            times[kpt].append(bench_ms(run))
    S.TOPK_WARPS.update(default)
    for kpt in KPT:
        t = sorted(times[kpt])[1]
        res.append(dict(shape=name, b=b, h=h, L=L, nk=nk, keys_per_thread=kpt, select_ms=t, rounds=times[kpt],
                        same=same[kpt]))
        print(f"{name:14} Nk={nk:5d} keys/thread {kpt:3d}: select {t:.3f} ms {[round(x, 3) for x in times[kpt]]}"
              f"{'' if same[kpt] else ' DIFFERENT SELECTION'}", flush=True)
    st = ws = None  # free the statistics before the next shape
    torch.cuda.empty_cache()
out = os.environ.get("OUT", ".")
with open(os.path.join(out, "select_wide.json"), "w") as f:
    json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=res), f, indent=1)
