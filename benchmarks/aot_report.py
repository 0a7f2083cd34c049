"""Compile the kernels for sm_90 on a machine without a GPU and print registers / spills / shared
memory / whether wgmma was emitted (uses the ptxas that ships with Triton). No device needed.

    python benchmarks/aot_report.py
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pisa_attn.ops.triton import attention as A
from pisa_attn.ops.triton import prepare as P
from pisa_attn.ops.triton import select as S


# What Triton's JIT sees at run time: unit inner strides become constants, pointers and the other
# strides / lengths used here are multiples of 16 (divisibility hints).
UNIT = ("sqd", "skd", "svd", "sod")
DIV16 = ("sqb", "sqh", "sql", "skb", "skh", "skl", "svb", "svh", "svl", "sob", "soh", "sol", "LQ", "LK")


def _sig(fn, types: dict, constexprs: dict):
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in UNIT and name not in constexprs:
            constexprs[name] = 1
        # a pointer not named in ``types`` is taken as float32 (what most statistics buffers are)
        sig[name] = "constexpr" if name in constexprs else types.get(name, "*fp32" if name.endswith("_ptr") else "i32")
        if sig[name].startswith("*") or name in DIV16:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def _report(label, fn, types, constexprs, num_warps, num_stages=3):
    sig, attrs = _sig(fn, types, constexprs)
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.TemporaryDirectory() as td:
        cub = Path(td) / "k.cubin"
        cub.write_bytes(c.asm["cubin"])
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        res = subprocess.run([str(tool), "--dump-resource-usage", str(cub)], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    ptx = c.asm["ptx"]
    print(f"{label:42s} warps={num_warps} stages={num_stages} regs={regs.group(1) if regs else '?'} "
          f"stack={stack.group(1) if stack else '?'} smem={c.metadata.shared} wgmma={len(re.findall('wgmma.mma_async', ptx))} "
          f"mma.sync={len(re.findall('mma.sync', ptx))} cp.async={len(re.findall('cp.async', ptx))}")


def main():
    attn_types = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "vbar_ptr", "o_ptr")}
    attn_types.update(kbar_ptr="*fp16", kscale_ptr="*fp32", hbar_ptr="*bf16", alpha_ptr="*fp32", idx_ptr="*i32", cnt_ptr="*i32", bits_ptr="*i32", lse_ptr="*fp32",
                      qk_scale="fp32", scale="fp32")
    which = sys.argv[1:] or ["attn", "prep", "select"]
    if "attn" in which:
        for d in (64, 128):
            for mode in (0, 2):
                for warps, stages, se, st in ((4, 2, None, None), (4, 3, None, None), (4, 2, 3, 2), (4, 2, 3, 1)):
                    for c in ((64,) if mode == 0 else (32, 64)):
                        ce = dict(BS=64, D=d, C=c, MODE=mode, EVEN_K=True, LOG2_BS=6.0, F32=False,
                                  S_EXACT=se, S_TAIL=st)
                        _report(f"attn D={d} mode={mode} C={c} se={se} st={st}", A._attn_kernel, attn_types, ce,
                                warps, stages)
    if "prep" in which:
        types = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "vbar_ptr", "hbar_lp_ptr")}
        types.update(excl_ptr="*u8", qmean_ptr="*fp32", kmean_ptr="*fp32", part_h_ptr="*fp32", part_s_ptr="*fp32",
                     hbar_ptr="*fp32", kbar_ptr="*fp16", kscale_ptr="*fp32", hdev_ptr="*fp32")
        for d in (64, 128):
            for qb in (64, 128):
                for stages in (2, 3, 4):
                    _report(f"stats D={d} QB={qb}", P._stats_kernel, types,
                            dict(BS=64, QB=qb, QT=P._q_tile(qb, d), D=d, F32=False, CLAMP=False, HAS_EXCL=False, VMAX=False),
                            P._stats_warps(d), stages)
            _report(f"stats D={d} excl", P._stats_kernel, types,
                    dict(BS=64, QB=64, QT=P._q_tile(64, d), D=d, F32=False, CLAMP=False, HAS_EXCL=True, VMAX=False),
                    P._stats_warps(d), 3)
            _report(f"finish D={d}", P._finish_kernel, types, dict(D=d, RB=16, TJ=32), 4, 2)
            _report(f"hdev D={d}", P._hdev_kernel, types, dict(BS=64, D=d, F32=False, CLAMP=False), P._stats_warps(d), 2)
    if "select" in which:
        types = dict(scores_ptr="*fp32", qmean_ptr="*fp32", kmean_ptr="*fp32", out_ptr="*fp32", hdev_ptr="*fp32",
                     keep_ptr="*u8", idx_ptr="*i32", cnt_ptr="*i32", bits_ptr="*i32", scale="fp32")
        for nkp in (64, 128, 256):
            for warps in (4, 8):
                _report(f"select NKP={nkp} R=64 tf32", S._select_kernel, types,
                        dict(R=64, NKP=nkp, D=128, COV=False, HAS_KEEP=False, REP=1, PREC="tf32", BITS=2), warps, 1)
                _report(f"select NKP={nkp} R=64", S._select_kernel, types,
                        dict(R=64, NKP=nkp, D=128, COV=False, HAS_KEEP=False, REP=1, PREC="tf32x3", BITS=2), warps, 1)
        for cov, keep in ((True, False), (True, True), (False, True)):  # the default fused kernel's variants
            _report(f"select NKP=64 R=64 cov={cov} keep={keep}", S._select_kernel, types,
                    dict(R=64, NKP=64, D=128, COV=cov, HAS_KEEP=keep, REP=1, PREC="tf32x3", BITS=2), 4, 1)
        for cov in (False, True):
            _report(f"scores D=128 64x64 cov={cov}", S._scores_kernel, types,
                    dict(BM=64, BN=64, D=128, PREC="tf32x3", COV=cov), 4, 1)
        for nkp in (512, 1024, 4096):
            for warps in (1, 2):
                r = max(1, min(64, 1024 * warps // nkp))
                _report(f"topk NKP={nkp} R={r}", S._topk_kernel, types,
                        dict(R=r, NKP=nkp, HAS_KEEP=False, REP=1, BITS=2), warps, 1)


if __name__ == "__main__":
    main()
