"""Cross-compiling kernels for sm_90a on a machine without a GPU (Triton ships ``ptxas``), in
another process: the test session runs Triton's interpreter (TRITON_INTERPRET=1), under which
kernels cannot be compiled. One such process per test process runs every build script in turn
(starting one per script cost about 5 s of imports each on a two-core CI machine).
:func:`build` returns, per variant, what the tests assert on the PTX."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import multiprocessing
import os
import sys
import traceback
from types import SimpleNamespace

import triton

SMEM_LIMIT = 227 * 1024  # Hopper's shared memory per block

# The GPU machines' Triton (3.6) and its ptxas, whose register allocation the spill counts assert.
DEVICE_TOOLCHAIN = triton.__version__.startswith("3.6.")
# Every variant of every build test: with the device toolchain (`make build-device`) or when asked.
# Otherwise (CPU CI, 2 cores) each test builds a subset that still covers each option once: the
# whole set costs about 8 minutes of ptxas there.
FULL = DEVICE_TOOLCHAIN or os.environ.get("PISA_ATTN_FULL_BUILD") == "1"


def ci_subset(variants: dict, names) -> dict:
    """``variants`` under :data:`FULL`, else only ``names`` of them (each must be one)."""
    missing = set(names) - set(variants)
    if missing:
        raise KeyError(f"not variants: {sorted(missing)}")
    return dict(variants) if FULL else {n: v for n, v in variants.items() if n in names}

_SCRIPT = """
import json, os, re, subprocess, sys, tempfile, torch, triton
{imports}
# ptxas's own spills show only in the SASS (cuobjdump ships with Triton beside ptxas)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
def sass_spills(cubin):
    if not os.path.exists(CUOBJDUMP):
        raise FileNotFoundError(CUOBJDUMP + ": Triton's cuobjdump, needed to read ptxas's spills")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return (len(re.findall(r"\\b(?:STL|LDL)\\b", sass)), *loop_stats(sass))
def loop_stats(sass):
    # In the innermost loops that issue tensor-core products (a loop: the range of a backward
    # branch, not one from the out-of-line barrier retries after the last EXIT; the hot loops, not
    # the code around them): local loads/stores, and the loops whose products are serialised (a
    # wait after every product instruction (HGMMA, QGMMA, IGMMA): ptxas does that when an operand's
    # registers are not stable, e.g. spilled; a 64x64 8-bit product is only two instructions).
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\\*([0-9a-f]{{4,}})\\*/\\s+([^;]*);", sass)]
    end = max(a for a, t in ins if t.strip() == "EXIT")
    loops = []
    for addr, txt in ins:
        m = re.search(r"BRA\\s+0x([0-9a-f]+)", txt)
        if m and int(m.group(1), 16) < addr < end:
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            if any(re.search(r"\\b[HQI]GMMA\\b", t) for t in body):
                loops.append((int(m.group(1), 16), addr, body))
    inner = [l for l in loops if not any(o is not l and l[0] <= o[0] and o[1] < l[1] for o in loops)]
    spills = sum(len(re.findall(r"\\b(?:STL|LDL)\\b", "\\n".join(b))) for _, _, b in inner)
    serial = sum(sum("DEPBAR" in t for t in b) >= sum(bool(re.search(r"\\b[HQI]GMMA\\b", t)) for t in b)
                 for _, _, b in inner)
    return spills, serial
def grid_wait_first(ptx):
    # the grid wait before the kernel's first load, barrier set-up or bulk copy (None: no wait)
    body = ptx[ptx.index("{{", ptx.index(".entry")):]
    at = body.find("griddepcontrol.wait")
    if at < 0:
        return None
    firsts = [body.find(s) for s in ("ld.global", "mbarrier.init", "cp.async") if s in body]
    return not firsts or at < min(firsts)
res = {{}}
for name, args in json.loads(sys.argv[1]).items():
    k = {call}
    ptx = k.asm["ptx"]
    res[name] = dict(triton=triton.__version__, shared=k.metadata.shared, sm90a=".target sm_90a" in ptx,
                     fp8_wgmma=len(re.findall(r"wgmma\\.mma_async[^\\n]*\\.e4m3\\.e4m3", ptx)),
                     s8_wgmma=len(re.findall(r"wgmma\\.mma_async[^\\n]*\\.s8\\.s8", ptx)),
                     wgmma=len(re.findall(r"wgmma\\.mma_async", ptx)),
                     tma=len(re.findall(r"cp\\.async\\.bulk\\.tensor", ptx)),
                     cp_async=len(re.findall(r"cp\\.async\\.c[ag]\\.shared", ptx)),
                     tma2d=len(re.findall(r"cp\\.async\\.bulk\\.tensor\\.2d", ptx)),
                     ld_global=len(re.findall(r"\\bld\\.global\\b", ptx)),
                     wait1=len(re.findall(r"wgmma\\.wait_group\\.sync\\.aligned\\s+1;", ptx)),
                     setmaxnreg=len(re.findall(r"setmaxnreg", ptx)),
                     grid_wait=len(re.findall(r"griddepcontrol\\.wait", ptx)),
                     grid_wait_first=grid_wait_first(ptx),
                     local=len(re.findall(r"\\b(?:ld|st)\\.local\\b", ptx)), cubin=len(k.asm["cubin"]),
                     **dict(zip(("spills", "loop_spills", "loop_serialized"), sass_spills(k.asm["cubin"]))))
print(json.dumps(res))
"""


def _serve(conn) -> None:
    """The build process: runs each ``(script, args)`` it is sent as ``python -c script *args``
    would, and answers ``(True, stdout)`` or ``(False, traceback)``."""
    importlib.import_module("torch")  # what every build script imports: once, here

    while (msg := conn.recv()) is not None:
        script, args = msg
        out = io.StringIO()
        try:
            sys.argv = ["-c", *args]
            with contextlib.redirect_stdout(out):
                exec(compile(script, "<build script>", "exec"), {"__name__": "__main__"})
            conn.send((True, out.getvalue()))
        except BaseException:  # noqa: BLE001 - reported to the test with its traceback
            conn.send((False, traceback.format_exc()))


_SERVER: list = []  # [process, connection] once started


def _server():
    if not _SERVER or not _SERVER[0].is_alive():
        ctx = multiprocessing.get_context("spawn")
        conn, child = ctx.Pipe()
        # started without the interpreter flag: Triton reads it when a kernel (or Triton itself) is
        # imported, so the flag must be absent from the process from its start
        saved = os.environ.pop("TRITON_INTERPRET", None)
        try:
            proc = ctx.Process(target=_serve, args=(child,), daemon=True)
            proc.start()
        finally:
            if saved is not None:
                os.environ["TRITON_INTERPRET"] = saved
        _SERVER[:] = [proc, conn]
    return _SERVER


def run_script(script: str, *args: str, timeout: float = 600) -> SimpleNamespace:
    """Run ``script`` as ``python -c script args`` would, without the interpreter flag, in this
    test process's build process; ``.stdout`` holds what it printed (a failure fails the test with
    its traceback)."""
    proc, conn = _server()
    conn.send((script, args))
    if not conn.poll(timeout):
        proc.kill()
        _SERVER.clear()
        raise AssertionError(f"a build script ran past {timeout} s")
    ok, text = conn.recv()
    assert ok, text[-4000:]
    return SimpleNamespace(stdout=text)


def build(imports: str, call: str, variants: dict) -> dict:
    """Compile every variant (``call``: an expression of ``args``, the variant's tuple) and count
    in its PTX: wgmma (all, FP8, INT8), TMA copies (all, 2D), ``cp.async`` copies, ``wait_group 1``,
    setmaxnreg, ``griddepcontrol.wait`` (``grid_wait``; ``grid_wait_first``: it comes before the
    first load, barrier set-up or copy), global and local loads/stores; ``spills``: local stores
    and loads in the SASS, ``loop_spills``: those inside
    the innermost loops that issue tensor-core products, ``loop_serialized``: those loops that wait
    after every product instruction."""
    p = run_script(_SCRIPT.format(imports=imports, call=call), json.dumps(variants))
    return json.loads(p.stdout.strip().splitlines()[-1])
