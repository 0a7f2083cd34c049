"""What the two barriers Triton puts into every entry of the Hopper kernel's exact loop cost.

Triton 3.6's shared-memory barrier pass gives each consumer warpgroup two 128-thread ``bar.sync``
per union entry: one before the slot's release (``mbarrier.arrive`` is issued by one thread, so
every warp's reads of the slot must be finished first) and one before the next slot's ``ready``
wait (it orders consecutive waits on one barrier array). Three builds of the bf16 kernel, attend
alone on one top-k selection per case, every build once per round, ``--rounds`` interleaved rounds,
median; outputs and LSE compared bit for bit with the library's kernel:

* ``base``: the library's kernel;
* ``thread``: every consumer thread releases a slot itself (``cp.async.mbarrier.arrive.noinc``,
  the empty barriers count 128 arrivals per consumer), so the compiler puts no barrier before it;
* ``thread-nobar``: ``thread`` with the barrier before the exact loop's ``ready`` wait deleted
  from its PTX (``TRITON_KERNEL_OVERRIDE``): the loop a compiler aware of the ring protocol would
  emit. Safe for this protocol: a warp cannot wait on a slot a phase early, because the loader
  refills a slot only after all 128 threads of every consumer released it.

The variants are copies of ``ops/hopper/attention.py`` written to a temporary folder and loaded as
modules of the package; nothing in the library changes. Two processes run: one compiles the
``thread-nobar`` kernels and dumps their PTX, the next times all three with the edited PTX.

    PYTHONPATH=src OUT=DIR python3 benchmarks/release_barriers.py --lengths 32768 65536 --rounds 3
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
KERNEL = HERE.parent / "src" / "pisa_attn" / "ops" / "hopper" / "attention.py"
MARK = "  # thread-nobar"


def _thread_release(src: str) -> str:
    src = src.replace("from triton.experimental.gluon.nvidia.hopper import TensorDescriptor",
                      "from triton.experimental.gluon.nvidia.hopper import TensorDescriptor\n"
                      "from triton.experimental.gluon.language.nvidia.ampere import async_copy as _cp")
    src, n = re.subn(r"mbarrier\.arrive\(empty\.index\((\w+)\), count=1\)",
                     r"_cp.mbarrier_arrive(empty.index(\1), increment_count=False)", src)
    if n == 0 or "mbarrier.init(empty.index(s), count=NC)" not in src:
        raise RuntimeError("the kernel's slot release is not where this benchmark expects it")
    return src.replace("mbarrier.init(empty.index(s), count=NC)", "mbarrier.init(empty.index(s), count=NC * 128)")


def _thread_release_marked(src: str) -> str:
    """``thread`` under another source hash, the exact loop's ready wait marked for the PTX edit."""
    src = _thread_release(src)
    old = "    s = u % STAGES\n    mbarrier.wait(ready.index(s), (u // STAGES) & 1)\n    if ((code >> CID) & 1) != 0:"
    if src.count(old) != 1:
        raise RuntimeError("the exact loop's ready wait is not where this benchmark expects it")
    return src.replace(old, old.replace("    s = u % STAGES", "    s = u % STAGES" + MARK))


VARIANTS = {"thread": _thread_release, "thread-nobar": _thread_release_marked}


def _file(folder: Path, name: str) -> Path:
    return folder / f"_variant_{name.replace('-', '_')}.py"


def write_variants(folder: Path) -> None:
    src = KERNEL.read_text()
    for name, edit in VARIANTS.items():
        _file(folder, name).write_text(edit(src))


def load_variant(folder: Path, name: str):
    """The copy as ``pisa_attn.ops.hopper._variant_*`` (its relative imports resolve in the package)."""
    path = _file(folder, name)
    spec = importlib.util.spec_from_file_location(f"pisa_attn.ops.hopper.{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def edit_ptx(dump: Path, override: Path, folder: Path) -> dict:
    """Delete, in every dumped PTX of the marked copy, the ``bar.sync`` attributed to the exact
    loop's ready wait; write the edited files where ``TRITON_OVERRIDE_DIR`` finds them."""
    path = _file(folder, "thread-nobar")
    lines = path.read_text().splitlines()
    wait_line = next(i for i, line in enumerate(lines) if MARK in line) + 2  # 1-based: the next line
    removed = {}
    for ptx in dump.glob("*/*.ptx"):
        text = ptx.read_text()
        fids = [i for i, f in re.findall(r'\.file\s+(\d+)\s+"([^"]+)"', text) if f.endswith(path.name)]
        if not fids:
            continue
        out, loc, n = [], None, 0
        for line in text.split("\n"):
            m = re.match(r"\s*\.loc\s+(\d+)\s+(\d+)\s", line)
            if m:
                loc = (m.group(1), int(m.group(2)))
            if re.match(r"\s*bar\.sync\s+\d+,\s*128;", line) and loc == (fids[0], wait_line):
                n += 1
                continue
            out.append(line)
        removed[ptx.parent.name] = n
        if n:
            (override / ptx.parent.name).mkdir(parents=True, exist_ok=True)
            (override / ptx.parent.name / ptx.name).write_text("\n".join(out))
    return removed


def measure(folder: Path, lengths, rounds: int) -> list:
    """Every build, drop and hybrid, two and three query blocks per CTA; rounds == 0 only compiles."""
    import torch

    sys.path.insert(0, str(HERE))
    import exact_loop as E
    from pisa_attn.metrics import rel_l1
    from pisa_attn.ops.hopper import attention as base

    mods = {"base": base, **{n: load_variant(folder, n) for n in VARIANTS}}
    rows = []
    for L in lengths:
        t_cudnn = E.cudnn_ms(L) if rounds else None
        for source in ("random", "dit"):
            q, k, v = E.qkv(source, L)
            stats, sel, n_sel = E.selection(q, k, v, 0.125)
            frac = sel.cnt.sum().item() / (E.B * E.H * sel.bits.shape[2] * stats.kbar.shape[2])
            fns, ref = [], {}
            for qg in (2, 3):
                for mode in ("drop", "hybrid"):
                    for name, mod in mods.items():
                        out = torch.full_like(q, float("nan"))
                        lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
                        fn = (lambda mod=mod, mode=mode, out=out, lse=lse, qg=qg: mod.attention(
                            q, k, v, *stats.tail(), *sel, mode=mode, scale=E.D ** -0.5, block_size=64,
                            n_select=n_sel, out=out, lse=lse, query_group=qg, kbound=stats.kbound))
                        fn()
                        torch.cuda.synchronize()
                        b = ref.setdefault((qg, mode), (out.clone(), lse.clone()))
                        row = dict(L=L, source=source, query_group=qg, mode=mode, variant=name, cudnn_ms=t_cudnn,
                                   computed_fraction=frac, finite=bool(torch.isfinite(out).all()),
                                   bit_identical_to_base=bool(torch.equal(out, b[0]) and torch.equal(lse, b[1])),
                                   rel_l1_to_base=rel_l1(out, b[0]), ms_rounds=[])
                        rows.append(row)
                        fns.append((row, fn))
            for _ in range(rounds):
                for row, fn in fns:
                    row["ms_rounds"].append(E.ms(fn, est_ms=t_cudnn * frac))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--phase", choices=("compile", "time"), help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.phase:  # a child process
        rows = measure(Path(a.folder), a.lengths, a.rounds if a.phase == "time" else 0)
        if a.phase == "time":
            (Path(a.folder) / "rows.json").write_text(json.dumps(rows))
        return 0
    with tempfile.TemporaryDirectory() as td:
        folder = Path(td)
        write_variants(folder)
        env = dict(os.environ, TRITON_CACHE_DIR=str(folder / "cache1"), TRITON_KERNEL_DUMP="1",
                   TRITON_DUMP_DIR=str(folder / "dump"))
        child = [sys.executable, __file__, "--folder", td, "--lengths", *map(str, a.lengths), "--rounds", str(a.rounds)]
        subprocess.run(child + ["--phase", "compile"], env=env, check=True)
        removed = edit_ptx(folder / "dump", folder / "override", folder)
        print("barriers removed per thread-nobar kernel:", removed, flush=True)
        if not removed or min(removed.values()) < 2:
            raise RuntimeError(f"expected one barrier per consumer loop in every kernel: {removed}")
        env = dict(os.environ, TRITON_CACHE_DIR=str(folder / "cache2"), TRITON_KERNEL_OVERRIDE="1",
                   TRITON_OVERRIDE_DIR=str(folder / "override"))
        subprocess.run(child + ["--phase", "time"], env=env, check=True)
        rows = json.loads((folder / "rows.json").read_text())
    base = {}
    for r in rows:
        r["ms"] = statistics.median(r["ms_rounds"])
        r["share_of_cudnn"] = r["computed_fraction"] * r["cudnn_ms"] / r["ms"] if r["mode"] == "drop" else None
        if r["variant"] == "base":
            base[r["L"], r["source"], r["query_group"], r["mode"]] = r["ms"]
    print(f"\n{'L':>6} {'input':7} {'qg':>2} {'mode':6} {'build':13} {'ms':>8} {'/ base':>7} {'share':>6} bits")
    for r in rows:
        r["vs_base"] = r["ms"] / base[r["L"], r["source"], r["query_group"], r["mode"]]
        share = f"{r['share_of_cudnn']:.3f}" if r["share_of_cudnn"] else ""
        print(f"{r['L']:>6} {r['source']:7} {r['query_group']:>2} {r['mode']:6} {r['variant']:13} {r['ms']:8.3f} "
              f"{r['vs_base']:7.3f} {share:>6} {'same' if r['bit_identical_to_base'] else 'DIFFERENT'}")
    import torch
    import triton

    out = os.environ.get("OUT", ".")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "release_barriers.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       cudnn=torch.backends.cudnn.version(), barriers_removed=removed, rows=rows), f, indent=1)
    return 0 if all(r["bit_identical_to_base"] and r["finite"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
