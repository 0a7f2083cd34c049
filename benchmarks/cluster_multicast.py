"""The exact loop as a 2-CTA cluster with TMA multicast of K/V, against one CTA (measured; not kept).

The three-query-block Hopper kernel loads, per CTA, the union of its three 64-row query blocks'
exact key blocks: 0.879 tiles per computed block on Gaussian selections at 12.5 %. Six adjacent
blocks over two CTAs of a cluster share more (0.733): here is that design, the keep-or-drop loop
of ``ops/hopper/attention.py`` (sequential, online maximum) in three variants of one Gluon kernel:

* ``one-cta``: one CTA per three adjacent query blocks, its own union, plain TMA (the production
  kernel's stream; its output equals the production kernel's online keep-or-drop bit for bit);
* ``cluster-multicast``: a cluster of two CTAs per six adjacent blocks walks their union once;
  CTA 0 loads each K/V tile with ``multicast=True`` into the same ring slot of both CTAs and
  expects its bytes on both CTAs' ready barriers (``from_cta=0``); the consumers of both CTAs
  release a slot on CTA 0's empty barrier (``two_ctas=True``); consumer ``c`` of CTA ``r`` serves
  block ``6g + 2c + r``, so Q loads and O stores are one ``[128, D]`` box split over the cluster;
* ``walk6``: the control: CTAs in pairs walk the same six-block union without a cluster, each
  loading every tile itself (the cluster's per-SM bytes without its L2 saving).

Every variant's output is compared with the production kernel's (online and under its bound),
cuDNN SDPA timed in the same run. Needs Triton >= 3.9 (Gluon's multicast TMA, multi-CTA barriers,
``num_ctas=2``); the GPU machines ship 3.6, so a 3.9 install travels with the call (notes/kernel-notes.md
says how). B2-H16-D128 bf16, density 12.5 %, the library's selection.

    PYTHONPATH=/path/to/triton-3.9:src python3 benchmarks/cluster_multicast.py --smoke
    PYTHONPATH=/path/to/triton-3.9:src python3 benchmarks/cluster_multicast.py --out benchmarks/results/h100_cluster_multicast.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import exact_loop as el  # noqa: E402

from pisa_attn.ops.hopper import attention as gattn  # noqa: E402
from pisa_attn.ops.hopper.attention import _softmax_step  # noqa: E402
from pisa_attn.ops.selection import bits_to_mask  # noqa: E402

LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def _cta_rank(NCTA: gl.constexpr):
    if NCTA == 1:
        r = 0
    else:
        r = gl.inline_asm_elementwise("mov.u32 $0, %cluster_ctarank;", "=r", [], gl.int32, True, 1)
    return r


@gluon.jit
def _mc_loader(k_desc, v_desc, k_bufs, v_bufs, ready, empty, uidx_ptr, ucnt_ptr, grow, W, kv_row0,
               BS: gl.constexpr, STAGES: gl.constexpr, G: gl.constexpr, NCTA: gl.constexpr):
    n_union = gl.load(ucnt_ptr + grow)
    ubase = uidx_ptr + grow * W
    code = gl.load(ubase, mask=n_union > 0, other=0)
    for u in range(n_union):
        j = code >> G
        code = gl.load(ubase + u + 1, mask=u + 1 < n_union, other=0)
        s = u % STAGES
        # NCTA=2: the empty barrier lives in CTA 0 (both CTAs' consumers arrive there) and CTA 0 is the
        # one issuer: it expects on both CTAs' ready barriers (from_cta=0) and multicasts the tiles.
        mbarrier.wait(empty.index(s), ((u // STAGES) & 1) ^ 1)
        if NCTA == 2:
            mbarrier.expect(ready.index(s), k_desc.nbytes_per_cta + v_desc.nbytes_per_cta, from_cta=0)
        else:
            mbarrier.expect(ready.index(s), k_desc.nbytes_per_cta + v_desc.nbytes_per_cta)
        tma.async_load(k_desc, [kv_row0 + j * BS, 0], ready.index(s), k_bufs.index(s), multicast=NCTA == 2)
        tma.async_load(v_desc, [kv_row0 + j * BS, 0], ready.index(s), v_bufs.index(s), multicast=NCTA == 2)


@gluon.jit
def _mc_consumer(o_desc, lse_ptr, q_smem, k_bufs, v_bufs, q_bar, ready, empty, uidx_ptr, ucnt_ptr, grow, W,
                 q_row, active, qk_scale, CID: gl.constexpr, BS: gl.constexpr, D: gl.constexpr,
                 STAGES: gl.constexpr, G: gl.constexpr, NCTA: gl.constexpr, S_LAYOUT: gl.constexpr,
                 O_LAYOUT: gl.constexpr, EMU: gl.constexpr, re):
    s_layout: gl.constexpr = S_LAYOUT
    o_layout: gl.constexpr = O_LAYOUT
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    q16_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    r = _cta_rank(NCTA)
    bit = CID * NCTA * EMU + r + re  # this CTA's query block within the group of G
    q_s = q_smem.index(CID)
    mbarrier.wait(q_bar.index(CID), 0)
    qa = q_s.load(q16_layout)
    m_i = gl.full([NCTA * BS], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([NCTA * BS], gl.float32, layout=row_s)
    acc = gl.zeros([NCTA * BS, D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([NCTA * BS, BS], gl.float32, layout=s_layout)
    n_union = gl.load(ucnt_ptr + grow)
    ubase = uidx_ptr + grow * W
    code_next = gl.load(ubase, mask=n_union > 0, other=0)
    for u in range(n_union):
        code = code_next
        code_next = gl.load(ubase + u + 1, mask=u + 1 < n_union, other=0)
        s = u % STAGES
        mbarrier.wait(ready.index(s), (u // STAGES) & 1)
        if ((code >> bit) & 1) != 0:
            sc = warpgroup_mma(qa, k_bufs.index(s).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
            m_i, l_i, acc, rescale, ps = _softmax_step(m_i, l_i, acc, sc, qk_scale, v_bufs.index(s), s_layout,
                                                       o_layout, p_layout)
        mbarrier.arrive(empty.index(s), count=1)
    if active:
        out = acc / gl.convert_layout(l_i, row_o)[:, None]
        lse = (m_i + gl.log2(l_i)) * LN2
        rows = q_row + gl.arange(0, NCTA * BS, layout=row_s)
        gl.store(lse_ptr + rows, lse)
        q_s.store(out.to(q_s.dtype))
        fence_async_shared()
        tma.async_store(o_desc, [q_row, 0], q_s)
        tma.store_wait(pendings=0)


@gluon.jit(do_not_specialize=["H", "HK", "LQ", "LK", "NQ", "NG", "W"])
def _mc_kernel(q_desc, k_desc, v_desc, o_desc, uidx_ptr, ucnt_ptr, lse_ptr, H, HK, LQ, LK, NQ, NG, W, qk_scale,
               BS: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, NC: gl.constexpr, NCTA: gl.constexpr,
               S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr, EMU: gl.constexpr = 1):
    g = gl.program_id(0)  # with NCTA=2, the cluster
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // (H // HK)
    bhk = b * HK + hk
    G: gl.constexpr = NC * NCTA * EMU
    # EMU=2 (NCTA=1): CTA pairs (2i, 2i+1) walk the union of 6 blocks as a cluster's two CTAs would,
    # each loading every tile itself: the cluster's stream without multicast.
    ge = g // EMU
    re = g % EMU
    grow = bh * NG + ge
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [NC] + q_desc.block_shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_shape, v_desc.layout)
    q_bar = mbarrier.allocate_mbarrier(batch=NC)
    ready = mbarrier.allocate_mbarrier(batch=STAGES)
    empty = mbarrier.allocate_mbarrier(batch=STAGES, two_ctas=NCTA == 2)
    for c in gl.static_range(NC):
        mbarrier.init(q_bar.index(c), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=NC)  # NCTA=2: lowered to 2*NC in CTA 0
    fence_async_shared(cluster=NCTA == 2)
    for c in gl.static_range(NC):
        mbarrier.expect(q_bar.index(c), q_desc.nbytes_per_cta)
        tma.async_load(q_desc, [bh * LQ + (ge * G + c * NCTA * EMU + re) * BS, 0], q_bar.index(c), q_smem.index(c))
    gl.warp_specialize([
        (_mc_loader, (k_desc, v_desc, k_bufs, v_bufs, ready, empty, uidx_ptr, ucnt_ptr, grow, W, bhk * LK,
                      BS, STAGES, G, NCTA)),
        (_mc_consumer, (o_desc, lse_ptr, q_smem, k_bufs, v_bufs, q_bar, ready, empty, uidx_ptr, ucnt_ptr, grow, W,
                        bh * LQ + (ge * G + 0 * NCTA * EMU + re) * BS, ge * G + 0 * NCTA * EMU + re < NQ, qk_scale,
                        0, BS, D, STAGES, G, NCTA, S_LAYOUT, O_LAYOUT, EMU, re)),
        (_mc_consumer, (o_desc, lse_ptr, q_smem, k_bufs, v_bufs, q_bar, ready, empty, uidx_ptr, ucnt_ptr, grow, W,
                        bh * LQ + (ge * G + 1 * NCTA * EMU + re) * BS, ge * G + 1 * NCTA * EMU + re < NQ, qk_scale,
                        1, BS, D, STAGES, G, NCTA, S_LAYOUT, O_LAYOUT, EMU, re)),
        (_mc_consumer, (o_desc, lse_ptr, q_smem, k_bufs, v_bufs, q_bar, ready, empty, uidx_ptr, ucnt_ptr, grow, W,
                        bh * LQ + (ge * G + 2 * NCTA * EMU + re) * BS, ge * G + 2 * NCTA * EMU + re < NQ, qk_scale,
                        2, BS, D, STAGES, G, NCTA, S_LAYOUT, O_LAYOUT, EMU, re)),
    ], [4, 4, 4], [160, 160, 160])


def layouts(ncta: int, bs: int = 64, d: int = 128, dtype=gl.bfloat16):
    cga = dict(cga_layout=[[1, 0]]) if ncta == 2 else {}
    kv_cga = dict(cga_layout=[[0, 0]]) if ncta == 2 else {}
    s = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, bs, 16], **cga)
    o = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, d, 16], **cga)
    q_l = gl.NVMMASharedLayout.get_default_for([ncta * bs, d], dtype, **cga)
    kv_l = gl.NVMMASharedLayout.get_default_for([bs, d], dtype, **kv_cga)
    return s, o, q_l, kv_l


def group_stream(mask: torch.Tensor, group: int):
    """(codes [BH, NG, W] int32: ``j << group | owners`` ascending in j; counts [BH, NG]) of every
    group of ``group`` adjacent query blocks, from the bool mask [BH, NQ, NK]."""
    bh, nq, nk = mask.shape
    ng = -(-nq // group)
    pad = torch.zeros(bh, ng * group, nk, dtype=torch.int64, device=mask.device)
    pad[:, :nq] = mask.long()
    sh = torch.arange(group, device=mask.device).view(1, 1, group, 1)
    owners = (pad.view(bh, ng, group, nk) << sh).sum(2)
    j = torch.arange(nk, device=mask.device)
    key = torch.where(owners > 0, j, nk + j)
    order = key.sort(-1).indices
    codes = (j[order] << group) | owners.gather(-1, order)
    cnt = (owners > 0).sum(-1)
    w = max(int(cnt.max().item()), 1)
    return codes[..., :w].int().contiguous(), cnt.int().contiguous()


STAGES = 5


def make_launch(q, k, v, mask, ncta: int, out=None, lse=None, emu: int = 1):
    """A launch of the prototype on ``q, k, v`` [B, H, L, D] (contiguous) and the selection ``mask``
    [B, H, NQ, NK]; returns (fn, out, lse, loads per computed block)."""
    b, h, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    bs, nc = 64, 3
    nq = lq // bs
    assert lq % bs == 0 and lk % bs == 0 and nq % ncta == 0
    g = nc * ncta * emu
    codes, cnt = group_stream(mask.reshape(b * h, nq, -1), g)
    ng = codes.shape[1]
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(b, h, lq, device=q.device, dtype=torch.float32) if lse is None else lse
    s_l, o_l, q_l, kv_l = layouts(ncta, bs, d)
    mk = lambda x, blk, lay: TensorDescriptor(x, list(x.shape), list(x.stride()), blk, lay)  # noqa: E731
    q2, o2 = q.view(-1, d), out.view(-1, d)
    k2, v2 = k.view(-1, d), v.view(-1, d)
    qd, od = mk(q2, [ncta * bs, d], q_l), mk(o2, [ncta * bs, d], q_l)
    kd, vd = mk(k2, [bs, d], kv_l), mk(v2, [bs, d], kv_l)
    scale = d ** -0.5 * 1.4426950408889634

    def fn():
        _mc_kernel[(ng * emu, b * h)](qd, kd, vd, od, codes, cnt, lse, h, hk, lq, lk, nq, ng, codes.shape[-1],
                                      scale, BS=bs, D=d, STAGES=STAGES, NC=nc, NCTA=ncta, S_LAYOUT=s_l,
                                      O_LAYOUT=o_l, EMU=emu, num_warps=4, num_ctas=ncta, maxnreg=128)

    loads = cnt.sum().item() / mask.sum().item()
    return fn, out, lse, loads


def compile_sm90(ncta: int, emu: int = 1):
    """The kernel compiled for sm_90a without a GPU (Triton ships ``ptxas``)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    bs, d = 64, 128
    s_l, o_l, q_l, kv_l = layouts(ncta, bs, d)
    x = torch.empty(4 * bs, d, dtype=torch.bfloat16)
    mk = lambda blk, lay: TensorDescriptor(x, list(x.shape), list(x.stride()), blk, lay)  # noqa: E731
    descs = dict(q_desc=mk([ncta * bs, d], q_l), o_desc=mk([ncta * bs, d], q_l), k_desc=mk([bs, d], kv_l),
                 v_desc=mk([bs, d], kv_l))
    consts = dict(BS=bs, D=d, STAGES=STAGES, NC=3, NCTA=ncta, S_LAYOUT=s_l, O_LAYOUT=o_l, EMU=emu)
    types = dict(uidx_ptr="*i32", ucnt_ptr="*i32", lse_ptr="*fp32", qk_scale="fp32")
    sig = {a: "constexpr" if a in consts else mangle_type(descs[a]) if a in descs else types.get(a, "i32")
           for a in _mc_kernel.arg_names}
    src = GluonASTSource(fn=_mc_kernel, signature=sig, constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_ctas=ncta, maxnreg=128))


# (name, CTAs per cluster, CTAs walking one six-block union without a cluster)
VARIANTS = (("one-cta", 1, 1), ("cluster-multicast", 2, 1), ("walk6", 1, 2))


def prod_fn(q, k, v, stats, sel, n_sel, exact_max):
    """The production kernel's keep-or-drop attend (three query blocks) on ``sel``: (launch, output)."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    return (lambda: gattn.attention(q, k, v, *stats.tail(), *sel, mode="drop", scale=q.shape[-1] ** -0.5,
                                    block_size=64, n_select=n_sel, out=out, lse=lse, query_group=3,
                                    kbound=stats.kbound, kmax=stats.kmax, exact_max=exact_max)), out


def smoke():
    """Every variant against the production kernel's online keep-or-drop on small shapes."""
    torch.manual_seed(0)
    for (b, h, L) in [(1, 2, 4096), (2, 4, 8192)]:
        q, k, v = (torch.randn(b, h, L, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        el.B, el.H = b, h
        stats, sel, n_sel = el.selection(q, k, v, 0.125)
        mask = bits_to_mask(sel.bits, stats.kbar.shape[2])
        fn, ref = prod_fn(q, k, v, stats, sel, n_sel, "online")
        fn()
        for name, ncta, emu in VARIANTS:
            f, o, _, loads = make_launch(q, k, v, mask, ncta, emu=emu)
            f()
            torch.cuda.synchronize()
            d = (o.float() - ref.float()).abs().max().item()
            print(f"smoke B{b}-H{h}-L{L} {name}: max |variant - production| = {d:.3g}, bit-equal "
                  f"{torch.equal(o, ref)}, tiles loaded per computed block {loads:.3f}", flush=True)
            assert torch.equal(o, ref), name
    el.B, el.H = 2, 16


def bench(lengths, sources, rounds, out):
    rows = []
    for L in lengths:
        t_cudnn = el.cudnn_ms(L)
        for source in sources:
            q, k, v = el.qkv(source, L)
            stats, sel, n_sel = el.selection(q, k, v, 0.125)
            mask = bits_to_mask(sel.bits, stats.kbar.shape[2])
            frac = mask.sum().item() / mask.numel()
            fns, outs, loads = {}, {}, {}
            for em in ("online", "bound"):
                fns[f"prod-{em}"], outs[f"prod-{em}"] = prod_fn(q, k, v, stats, sel, n_sel, em)
            for name, ncta, emu in VARIANTS:
                fns[name], outs[name], _, loads[name] = make_launch(q, k, v, mask, ncta, emu=emu)
            for f in fns.values():
                f()
            torch.cuda.synchronize()
            ref = outs["prod-online"]
            same = {key: bool(torch.equal(o, ref)) for key, o in outs.items()}
            diff = {key: (o.float() - ref.float()).abs().max().item() for key, o in outs.items()}
            ts = {key: [] for key in fns}
            for _ in range(rounds):  # interleaved rounds: a slow spell of the card hits every variant
                for key, f in fns.items():
                    ts[key].append(el.ms(f, est_ms=t_cudnn * frac))
            med = {key: sorted(v)[len(v) // 2] for key, v in ts.items()}
            rows.append(dict(L=L, source=source, cudnn_ms=t_cudnn, computed_fraction=frac,
                             tiles_per_computed_block=loads, ms=med, rounds_ms=ts, bit_equal_to_prod_online=same,
                             max_abs_diff_to_prod_online=diff,
                             share_of_cudnn={key: frac * t_cudnn / t for key, t in med.items()}))
            print(f"{L:>6} {source:7} tiles/computed block {loads} | " +
                  " ".join(f"{key} {t:.3f} ({frac * t_cudnn / t:.3f})" for key, t in med.items()) +
                  f" | bit-equal to prod-online {same}", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(dict(el.toolchain(), shape=f"B{el.B}-H{el.H}-D128", dtype="bfloat16",
                       density=0.125, rows=rows), f, indent=1)
    print("\nattend alone, ms (share of cuDNN's throughput on the computed blocks)")
    print("L      input   " + " ".join(f"{k:>17}" for k in rows[0]["ms"]))
    for r in rows:
        print(f"{r['L']:>6} {r['source']:7} " + " ".join(f"{t:9.3f} ({r['share_of_cudnn'][k]:.2f})"
                                                      for k, t in r["ms"].items()))


def build_report():
    """Per variant: multicast loads, cluster-routed barrier operations and ptxas spills (SASS local
    loads and stores) of the sm_90a build."""
    import re
    import subprocess
    import tempfile

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    for name, ncta, emu in VARIANTS:
        c = compile_sm90(ncta, emu)
        ptx = c.asm["ptx"]
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(c.asm["cubin"])
            f.flush()
            sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        spills = len(re.findall(r"\b(?:STL|LDL)\b", sass))
        print(f"{name}: shared {c.metadata.shared} B, multicast loads {ptx.count('multicast::cluster')}, "
              f"cluster-routed arrives {ptx.count('.shared::cluster.b64')}, "
              f"SASS local loads/stores {spills}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="small shapes, every variant against the production kernel")
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536])
    ap.add_argument("--sources", nargs="+", default=["random", "dit"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--build", action="store_true", help="only compile every variant for sm_90a and report it")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "cluster_multicast.json"))
    a = ap.parse_args(argv)
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
        raise SystemExit(f"needs Triton >= 3.9 (Gluon multicast TMA and multi-CTA barriers), found {triton.__version__}")
    if a.build:
        return build_report()
    t0 = time.time()
    print("triton", triton.__version__, torch.__version__, torch.cuda.get_device_name(), flush=True)
    if a.smoke:
        smoke()
    else:
        bench(a.lengths, a.sources, a.rounds, a.out)
    print(f"{time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
