"""Whole-call time (median of 20, ms) and a CRC of the output bits of one source tree, the one
PYTHONPATH picks: hybrid and keep-or-drop, bf16 and fp16, Hopper and Triton backends, 32K
B2-H16-D128 Gaussian, 12.5 %, cuDNN SDPA timed in the same process. Run it alternately on two
trees to compare them (one JSON line each):

    git archive REV src | tar -x -C /tmp/old
    for t in new old old new; do P=src; [ $t = old ] && P=/tmp/old/src
      PISA_ATTN_AUTOTUNE=0 PYTHONPATH=$P python3 benchmarks/whole_call_ab.py $t >> ab.jsonl; done
"""
import json, sys, time, torch, zlib
import pisa_attn
from pisa_attn import PisaSettings, plan, run
from torch.nn.attention import sdpa_kernel, SDPBackend
tag = sys.argv[1]
res = {"tree": tag, "file": pisa_attn.__file__}
def bench(fn, n=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
        e0.record(); fn(); e1.record(); torch.cuda.synchronize(); ts.append(e0.elapsed_time(e1))
    ts.sort(); return ts[len(ts) // 2]
x = torch.ones(8192, 8192, device="cuda")
t0 = time.time()
while time.time() - t0 < 1.0: x @ x
for dt in (torch.bfloat16, torch.float16):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 16, 32768, 128, device="cuda", dtype=dt, generator=g) for _ in range(3))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        res[f"cudnn_{dt}"] = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    for be in ("hopper", "triton"):
        for mode in ("hybrid", "drop"):
            p = plan(q, k, PisaSettings(density=0.125, backend=be, mode=mode))
            o = run(p, q, k, v)
            key = f"{be}_{mode}_{dt}"
            res[key] = bench(lambda: run(p, q, k, v))
            res[key + "_crc"] = zlib.crc32(o.view(torch.int16).cpu().numpy().tobytes())
print(json.dumps(res))
