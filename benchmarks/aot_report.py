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
        sig[name] = "constexpr" if name in constexprs else types.get(name, "i32")
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
        types = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "vbar_ptr")}
        types.update(kbar_ptr="*fp16", kscale_ptr="*fp32", qmean_ptr="*fp32", kmean_ptr="*fp32", hbar_ptr="*fp32", inv_nk="fp32")
        for d in (64, 128):
            t3 = dict(k_ptr="*bf16", v_ptr="*bf16", kmean_ptr="*fp32", kmax_ptr="*fp32", vbar_ptr="*bf16",
                      vsum_ptr="*fp32")
            _report(f"kv_means D={d}", P._kv_means_kernel, t3, dict(BS=64, D=d), 4, 3)
            t4 = dict(k_ptr="*bf16", v_ptr="*bf16", kmean_ptr="*fp32", vsum_ptr="*fp32", hbar_ptr="*fp32", inv_nk="fp32",
                      kmax_ptr="*fp32", kbar_ptr="*fp16", kscale_ptr="*fp32")
            _report(f"hbar D={d}", P._hbar_kernel, t4, dict(BS=64, D=d, F32=False), 8 if d >= 128 else 4, 3)
            _report(f"q_mean D={d}", P._q_mean_kernel, dict(q_ptr="*bf16", qmean_ptr="*fp32"), dict(BS=64, D=d), 4, 3)
            t2 = dict(k_ptr="*bf16", v_ptr="*bf16", kmean_ptr="*fp32", vsum_ptr="*fp32", hbar_ptr="*fp32", hdev_ptr="*fp32")
            _report(f"hdev D={d}", P._hdev_kernel, t2, dict(BS=64, D=d, F32=False), 8 if d >= 128 else 4, 3)
    if "select" in which:
        types = dict(scores_ptr="*fp32", hdev_ptr="*fp32", keep_ptr="*u8", idx_ptr="*i32", cnt_ptr="*i32",
                     bits_ptr="*i32", scale="fp32")
        for nkp in (64, 512, 1024, 4096):
            for warps in (1, 2, 4, 8):
                r = max(1, min(64, 1024 * warps // nkp))
                _report(f"topk NKP={nkp} R={r}", S._topk_kernel, types,
                        dict(R=r, NKP=nkp, COV=False, HAS_KEEP=False), warps, 1)

if __name__ == "__main__":
    main()
