"""One call of each attention kernel at 32K / 12.5 % (B2-H16-D128, bf16) for ncu:

    ncu --clock-control none -k regex:attn --launch-skip 2 --launch-count 2 --section SpeedOfLight \\
        python3 tests/gpu/profile_pair.py
"""
import torch

from gluon_check import attend, qkv, run_stages  # noqa: E402  (run from tests/gpu or with it on sys.path)
from pisa_attn.attention import make_plan

q, k, v = qkv(2, 16, 16, 32768, 32768, 128, torch.bfloat16, "bhsd", seed=0)
for mode in ("drop", "hybrid"):
    plan = make_plan(q, k, 0.125, 64, mode, False, None, "triton")
    stats, s = run_stages(q, k, v, plan)
    for which in ("gluon", "triton"):
        attend(which, q, k, v, stats, s, plan, poison=False)
torch.cuda.synchronize()
