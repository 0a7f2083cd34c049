"""GPU time of PISA's statistics and selection per phase (no attend), B2-H16-D128 bf16, density 12.5 %,
with cuDNN SDPA timed in the same run, and checks of the kernels against the float64 reference.

    PYTHONPATH=src python3 benchmarks/stats_select_bench.py [--baseline DIR] [--lengths 4096,32768]

Phases (``triton.testing.do_bench`` medians, L2 flushed; ``outside`` = prepare + select + pair union
with workspaces, replayed from a CUDA graph: the GPU time a call spends outside the attend kernel):
``prep`` (no covariance term), ``prep_cov`` (with ``||H_j − H̄||``), ``select`` (top-k), ``select_cov``
(covariance-aware, the library's default), ``select_cov_keep`` (and ``N_KEEP`` kept key blocks), ``prep_fp8`` (prepare with the e4m3 copies of K and V), ``union``, ``host_us``
(host time per eager prepare + select + union call, 200 calls queued without synchronising).
``--baseline DIR`` holds earlier ``prepare.py`` / ``select.py`` (loaded as modules of
``pisa_attn.ops.triton``) and times them the same way. Variants: ``STATS_TUNING`` (waves, pipelining depth, q tile), and the
one-kernel selection against the two-kernel one where a row fits. Writes ``$OUT/stats_select.json``
and prints a table last.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from pisa_attn import spec
from pisa_attn.ops import reference as ref
from pisa_attn.bench.kernels import capture_graph
from pisa_attn.ops.selection import bits_to_mask
from pisa_attn.ops.triton import pairs as PU
from pisa_attn.ops.triton import prepare as P
from pisa_attn.ops.triton import select as S
from pisa_attn.ops.triton.op import score_scratch

B, H, D, BS, DENSITY = 2, 16, 128, 64, 0.125
N_KEEP = 8  # kept key blocks in the `select_cov_keep` phase (as 512 text tokens after the others)


def idx_to_mask(idx, cnt, n_kv_blocks: int):
    """The bool ``[B, H, Nq, Nk]`` mask named by the first ``cnt`` entries of ``idx`` (to check the
    index list against the bitmask, and to compare two selections)."""
    valid = torch.arange(idx.shape[-1], device=idx.device) < cnt[..., None]
    mask = torch.zeros(*idx.shape[:-1], n_kv_blocks + 1, dtype=torch.bool, device=idx.device)
    mask.scatter_(-1, torch.where(valid, idx.long(), n_kv_blocks), True)
    return mask[..., :n_kv_blocks]


def ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def graph_ms(fn) -> float:
    """GPU time of ``fn``'s launches with no host in between: a captured graph's replay."""
    return ms(capture_graph(fn, warmup=3).replay)


def host_us(fn, n: int = 200) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return t


def rel(a, b) -> float:
    return ((a.double() - b.double()).abs().sum() / b.double().abs().sum().clamp_min(1e-300)).item()


def load_baseline(path: str, names=("prepare", "select")):
    """The earlier modules ``names`` in ``path``, loaded as modules of ``pisa_attn.ops.triton``."""
    mods = {}
    for name in names:
        spec_ = importlib.util.spec_from_file_location(f"pisa_attn.ops.triton._base_{name}",
                                                       os.path.join(path, f"{name}.py"))
        m = importlib.util.module_from_spec(spec_)
        sys.modules[spec_.name] = m
        spec_.loader.exec_module(m)
        mods[name] = m
    return tuple(mods[n] for n in names)


def checks(q, k, v, nk, n_sel, width, scale, res):
    """New kernels against the float64 reference (and the workspace path against the allocating one)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    excl = torch.rand(1, H, nk, generator=g, device="cuda") < 0.25
    st = P.prepare(q, k, v, BS, with_hdev=True)
    st_x = P.prepare(q, k, v, BS, with_hdev=True, hbar_exclude=excl)
    qd, kd, vd = (x.double() for x in (q, k, v))
    rs = ref.prepare(qd, kd, vd, BS, with_hdev=True)
    rx = ref.prepare(qd, kd, vd, BS, with_hdev=True, hbar_exclude=excl)
    c = {"qmean": rel(st.qmean, rs.qmean), "kmean": rel(st.kmean, rs.kmean),
         "vbar": rel(st.vbar.double() * rs.counts[:, None], rs.vsum), "hbar": rel(st.hbar, rs.hbar),
         "hbar_lp": rel(st.hbar_lp.double() * st.hscale.double()[..., None, None], rs.hbar), "hdev": rel(st.hdev, rs.hdev),
         "kbar": rel(st.kbar.double() * st.kscale.double()[..., None, None], rs.kmean),
         "hbar_excl": rel(st_x.hbar, rx.hbar), "hdev_excl": rel(st_x.hdev, rx.hdev)}
    ws = P.stats_workspace(q.shape, k.shape, q.dtype, q.device, block_size=BS, with_hdev=True)
    st_w = P.prepare(q, k, v, BS, with_hdev=True, ws=ws)
    c["ws_equal"] = all(torch.equal(getattr(st_w, f), getattr(st, f)) for f in ("qmean", "kmean", "kbar", "vbar", "hdev"))
    kw = dict(n_select=n_sel, width=width, scale=scale)
    for cov in (False, True):
        hd = st.hdev if cov else None
        sel = S.select(st.qmean, st.kmean, hdev=hd, **kw)
        mask = idx_to_mask(sel.idx, sel.cnt, nk)
        ok = torch.equal(mask, bits_to_mask(sel.bits, nk)) and bool((sel.cnt == n_sel).all())
        scores = ref.selection_scores(st.qmean.double(), st.kmean.double(), scale, None if hd is None else hd.double())
        expect = ref.select_blocks(scores, n_sel)
        c[f"sel_overlap_cov{int(cov)}"] = ((mask & expect).sum() / expect.sum()).item()
        c[f"sel_consistent_cov{int(cov)}"] = ok
    res["checks"] = c


def run_length(L: int, base, variants: bool, check: bool) -> dict:
    torch.manual_seed(L)
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    nk = spec.num_blocks(L, BS)
    n_sel = spec.num_selected(DENSITY, nk)
    width = spec.selection_width(nk, n_sel, 0)
    scale = D ** -0.5
    res: dict = {"L": L, "n_kv_blocks": nk, "n_select": n_sel}
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        res["cudnn_ms"] = ms(lambda: F.scaled_dot_product_attention(q, k, v))
    scratch = score_scratch(q, k)  # the op's budget
    kw = dict(n_select=n_sel, width=width, scale=scale)

    def new_phases(tag: str, qb: int | None = None):
        rep = spec.query_block_factor(qb, BS)
        ws = P.stats_workspace(q.shape, k.shape, q.dtype, q.device, block_size=BS, query_block=qb)
        ws_c = P.stats_workspace(q.shape, k.shape, q.dtype, q.device, block_size=BS, query_block=qb, with_hdev=True)
        st = P.prepare(q, k, v, BS, ws=ws, query_block=qb)
        sw = S.selection_workspace(B, H, nk, nk, width, q.device, repeat=rep, scratch_elems=scratch, pairs=True)
        sel = S.select(st.qmean, st.kmean, repeat=rep, n_q_blocks=nk, ws=sw, **kw)

        def whole():
            s_ = P.prepare(q, k, v, BS, ws=ws, lean=True, query_block=qb)
            se = S.select(s_.qmean, s_.kmean, repeat=rep, n_q_blocks=nk, ws=sw, **kw)
            PU.pair_union(se.bits, nk, width, out=sw.union)

        r = {"prep": ms(lambda: P.prepare(q, k, v, BS, ws=ws, query_block=qb)),
             "prep_cov": ms(lambda: P.prepare(q, k, v, BS, ws=ws_c, with_hdev=True, query_block=qb)),
             "select": ms(lambda: S.select(st.qmean, st.kmean, repeat=rep, n_q_blocks=nk, ws=sw, **kw)),
             "union": ms(lambda: PU.pair_union(sel.bits, nk, width, out=sw.union)),
             "outside_graph": graph_ms(whole), "outside_eager": ms(whole), "host_us": host_us(whole)}
        if qb is None:  # the low-precision call's prepare (statistics, |v| maxima, e4m3 copies of K and V)
            ws_q = P.stats_workspace(q.shape, k.shape, q.dtype, q.device, block_size=BS, quant="fp8")
            r["prep_fp8"] = ms(lambda: P.prepare(q, k, v, BS, ws=ws_q, quant="fp8"))
        if qb is None:  # the covariance-aware selection (the default), alone and with kept blocks
            sw_c = S.selection_workspace(B, H, nk, nk, width, q.device, scratch_elems=scratch)  # not sw: sel's
            sw_k = S.selection_workspace(B, H, nk, nk, width_k, q.device, scratch_elems=scratch)
            r["select_cov"] = ms(lambda: S.select(st_c.qmean, st_c.kmean, hdev=st_c.hdev, ws=sw_c, **kw))
            r["select_cov_keep"] = ms(lambda: S.select(st_c.qmean, st_c.kmean, hdev=st_c.hdev, keep=keep, ws=sw_k,
                                                       **kw_k))
        res[tag] = r
        return st, sel

    # The statistics the covariance-aware selections read (new and baseline alike), and kept blocks:
    # the last N_KEEP key blocks of every head.
    st_c = P.prepare(q, k, v, BS, with_hdev=True)
    keep = torch.zeros(1, 1, nk, dtype=torch.bool, device=q.device)
    keep[..., -N_KEEP:] = True
    width_k = spec.selection_width(nk, n_sel, N_KEEP)
    kw_k = dict(kw, width=width_k)
    st, sel = new_phases("new")
    new_phases("new_qb128", 128)
    if base is not None:
        bp, bsel = base
        bst = bp.prepare(q, k, v, BS)
        bs_ = bsel.select(bst.qmean, bst.kmean, scratch_elems=scratch, **kw)

        def whole_old():
            s_ = bp.prepare(q, k, v, BS, lean=True)
            se = bsel.select(s_.qmean, s_.kmean, scratch_elems=scratch, **kw)
            PU.pair_union(se.bits, nk, width)

        res["old"] = {"prep": ms(lambda: bp.prepare(q, k, v, BS)),
                      "prep_cov": ms(lambda: bp.prepare(q, k, v, BS, with_hdev=True)),
                      "prep_fp8": ms(lambda: bp.prepare(q, k, v, BS, quant="fp8")),
                      "select": ms(lambda: bsel.select(bst.qmean, bst.kmean, scratch_elems=scratch, **kw)),
                      "union": ms(lambda: PU.pair_union(bs_.bits, nk, width)),
                      "outside_graph": graph_ms(whole_old), "outside_eager": ms(whole_old), "host_us": host_us(whole_old)}
        res["old"]["select_cov"] = ms(lambda: bsel.select(st_c.qmean, st_c.kmean, hdev=st_c.hdev, scratch_elems=scratch,
                                                          **kw))
        res["old"]["select_cov_keep"] = ms(lambda: bsel.select(st_c.qmean, st_c.kmean, hdev=st_c.hdev, keep=keep,
                                                               scratch_elems=scratch, **kw_k))
        m_new = idx_to_mask(sel.idx, sel.cnt, nk)
        m_old = idx_to_mask(bs_.idx, bs_.cnt, nk)
        res["old_new_selection_overlap"] = ((m_new & m_old).sum() / m_old.sum()).item()
        for name, extra in (("cov", dict(kw)), ("cov_keep", dict(kw_k, keep=keep))):
            a_ = S.select(st_c.qmean, st_c.kmean, hdev=st_c.hdev, **extra)
            b_ = bsel.select(st_c.qmean, st_c.kmean, hdev=st_c.hdev, scratch_elems=scratch, **extra)
            res[f"old_new_same_{name}"] = (torch.equal(a_.cnt, b_.cnt) and torch.equal(a_.bits, b_.bits) and torch.equal(
                idx_to_mask(a_.idx, a_.cnt, nk), idx_to_mask(b_.idx, b_.cnt, nk)))
    if variants:
        v_ = {}
        keep_t = dict(P.STATS_TUNING)
        for waves, stages, qtb in ((1, 4, 32768), (2, 4, 32768), (4, 4, 32768)):
            P.STATS_TUNING.update(waves=waves, stages=stages, q_tile_bytes=qtb, short_blocks_per_sm=0)
            ws = P.stats_workspace(q.shape, k.shape, q.dtype, q.device, block_size=BS)
            try:
                v_[f"prep_w{waves}_s{stages}_q{qtb // 1024}k"] = ms(lambda: P.prepare(q, k, v, BS, ws=ws))
            except Exception as e:  # e.g. out of shared memory: reported, not fatal
                v_[f"prep_w{waves}_s{stages}_q{qtb // 1024}k"] = f"error: {type(e).__name__}: {str(e)[:120]}"
        P.STATS_TUNING.clear()
        P.STATS_TUNING.update(keep_t)
        keep_cfg = dict(S.FUSED)
        for name, cfg in (("two_kernel", dict(max_nkp=0)), ("fused64_w4", dict(max_nkp=64, rows=64, warps=4)),
                          ("fused128_w8", dict(max_nkp=128, rows=64, warps=8)),
                          ("fused256_w8", dict(max_nkp=256, rows=64, warps=8))):
            S.FUSED.update(keep_cfg)
            S.FUSED.update(cfg)
            if max(32, 1 << (nk - 1).bit_length()) > S.FUSED["max_nkp"] and name != "two_kernel":
                continue
            sw = S.selection_workspace(B, H, nk, nk, width, q.device, scratch_elems=scratch)
            try:
                v_[f"select_{name}"] = ms(lambda: S.select(st.qmean, st.kmean, ws=sw, **kw))
                s2 = S.select(st.qmean, st.kmean, ws=sw, **kw)
                v_[f"select_{name}_same"] = bool(torch.equal(s2.bits, sel.bits))
            except Exception as e:  # a variant that does not compile is reported, not fatal
                v_[f"select_{name}"] = f"error: {type(e).__name__}: {str(e)[:200]}"
        S.FUSED.clear()
        S.FUSED.update(keep_cfg)
        keep_b = dict(S.TOPK_WARPS)
        for bits, lim in ((1, 0), (2, 1 << 20)):
            S.TOPK_WARPS["two_bit_max_nkp"] = lim
            sw = S.selection_workspace(B, H, nk, nk, width, q.device, scratch_elems=scratch)
            v_[f"select_bits{bits}"] = ms(lambda: S.select(st.qmean, st.kmean, ws=sw, **kw))
            v_[f"select_bits{bits}_same"] = bool(torch.equal(S.select(st.qmean, st.kmean, ws=sw, **kw).bits, sel.bits))
        S.TOPK_WARPS.update(keep_b)
        keep_s = dict(S.SCORES_TILE)
        for bm, bn, w in ((64, 128, 8), (128, 64, 8), (128, 128, 8)):
            S.SCORES_TILE.update(bm=bm, bn=bn, warps=w)
            sw = S.selection_workspace(B, H, nk, nk, width, q.device, scratch_elems=scratch)
            try:
                v_[f"select_scores{bm}x{bn}w{w}"] = ms(lambda: S.select(st.qmean, st.kmean, ws=sw, **kw))
            except Exception as e:  # e.g. out of shared memory: reported, not fatal
                v_[f"select_scores{bm}x{bn}w{w}"] = f"error: {type(e).__name__}: {str(e)[:80]}"
        S.SCORES_TILE.update(keep_s)
        # score precision, and the scratch budget (chunks of query blocks per scores + top-k pair)
        m_ref = idx_to_mask(sel.idx, sel.cnt, nk)
        for name, prec, budget in (("tf32", "tf32", scratch), ("scratch_1pct", None, scratch // 4),
                                   ("scratch_whole", None, None), ("tf32_whole", "tf32", None)):
            keep_p = S.SCORES_PRECISION
            if prec:
                S.SCORES_PRECISION = prec
            sw = S.selection_workspace(B, H, nk, nk, width, q.device, scratch_elems=budget)
            try:
                v_[f"select_{name}"] = ms(lambda: S.select(st.qmean, st.kmean, ws=sw, scratch_elems=budget, **kw))
                s2 = S.select(st.qmean, st.kmean, ws=sw, scratch_elems=budget, **kw)
                v_[f"select_{name}_overlap"] = ((idx_to_mask(s2.idx, s2.cnt, nk) & m_ref).sum() / m_ref.sum()).item()
            except Exception as e:  # reported, not fatal
                v_[f"select_{name}"] = f"error: {type(e).__name__}: {str(e)[:80]}"
            S.SCORES_PRECISION = keep_p
        res["variants"] = v_
    res["kernels_new"] = kernel_table(q, k, v, nk, width, kw)
    if check:
        checks(q, k, v, nk, n_sel, width, scale, res)
    return res


def kernel_table(q, k, v, nk, width, kw) -> dict:
    """GPU time per kernel of one prepare (covariance-aware) + select + pair union, torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    ws = P.stats_workspace(q.shape, k.shape, q.dtype, q.device, block_size=BS, with_hdev=True)
    sw = S.selection_workspace(B, H, nk, nk, width, q.device, pairs=True)

    def whole():
        st = P.prepare(q, k, v, BS, ws=ws, with_hdev=True)
        se = S.select(st.qmean, st.kmean, hdev=st.hdev, ws=sw, **kw)
        PU.pair_union(se.bits, nk, width, out=sw.union)

    for _ in range(3):
        whole()
    torch.cuda.synchronize()
    n = 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            whole()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        dt = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if dt and e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.key[:60]] = round(dt / n / 1e3, 5)
    return out


def whole_ab(L: int) -> dict:
    """The whole hybrid call (plan/run, backend ``hopper``, the library's default selection) with
    the score buffer at 1 % and at the library's fraction of q, k, v, o bytes, in the exact-loop
    benchmark's interleaved rounds, cuDNN SDPA in the same run."""
    import statistics

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import exact_loop as E  # the inputs and whole-call timing of the exact-loop benchmark

    from pisa_attn import PisaSettings
    from pisa_attn.ops.triton import op as TO

    keep = TO.SCORE_SCRATCH_FRACTION
    t_cudnn = E.cudnn_ms(L)
    q, k, v = E.qkv("random", L)
    settings = PisaSettings(density=DENSITY, backend="hopper")
    ts = E.whole_rounds(q, k, v, {f: (lambda f=f: setattr(TO, "SCORE_SCRATCH_FRACTION", f), settings)
                                  for f in (0.01, keep)}, est_ms=t_cudnn * 0.16)
    TO.SCORE_SCRATCH_FRACTION = keep
    return {"L": L, "cudnn_ms": t_cudnn, "whole_ms_scratch_1pct": statistics.median(ts[0.01]),
            f"whole_ms_scratch_{round(keep * 100)}pct": statistics.median(ts[keep]),
            "rounds": {str(f): t for f, t in ts.items()}}


def ncu_launches(L: int) -> None:
    """One covariance-aware prepare and one selection at ``L`` (twice), for
    ``ncu -k regex:"_stats|_hdev|_scores|_topk"``."""
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    nk = spec.num_blocks(L, BS)
    n_sel = spec.num_selected(DENSITY, nk)
    width = spec.selection_width(nk, n_sel, 0)
    st = P.prepare(q, k, v, BS, with_hdev=True)
    sw = S.selection_workspace(B, H, nk, nk, width, q.device, scratch_elems=score_scratch(q, k))
    for _ in range(2):
        S.select(st.qmean, st.kmean, n_select=n_sel, width=width, scale=D ** -0.5, hdev=st.hdev, ws=sw)
    torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default=None)
    ap.add_argument("--lengths", default="4096,8192,32768,65536")
    ap.add_argument("--check-max", type=int, default=32768, help="float64 checks up to this length")
    ap.add_argument("--whole", default="", help="lengths of the whole-call A/B of the score buffer (e.g. 32768,65536)")
    ap.add_argument("--ncu", type=int, default=0, help="only one prepare + select at this length, for ncu")
    a = ap.parse_args()
    if a.ncu:
        return ncu_launches(a.ncu)
    base = load_baseline(a.baseline) if a.baseline else None
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": __import__("triton").__version__, "shape": f"B{B}-H{H}-D{D} bf16, density {DENSITY}", "rows": []}
    x = torch.randn(8192, 8192, device="cuda")
    t0 = time.time()
    while time.time() - t0 < 1.0:  # a busy GPU before the first timing (a cold first case read 2-4x slow)
        x @ x
    torch.cuda.synchronize()
    for L in (int(s) for s in a.lengths.split(",")):
        r = run_length(L, base, variants=True, check=L <= a.check_max)
        out["rows"].append(r)
        print(json.dumps(r), flush=True)
        torch.cuda.empty_cache()
    out["whole"] = [whole_ab(int(s_)) for s_ in a.whole.split(",") if s_]
    for r in out["whole"]:
        print(json.dumps(r), flush=True)
    path = os.path.join(os.environ.get("OUT", "."), "stats_select.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\n{out['device']}, torch {out['torch']}, triton {out['triton']}, {out['shape']}; ms (host in µs)")
    cols = ("prep", "prep_cov", "prep_fp8", "select", "select_cov", "select_cov_keep", "union", "outside_graph",
            "outside_eager", "host_us")
    print(f"{'L':>6} {'impl':>10} " + " ".join(f"{c:>13}" for c in cols) + f" {'cudnn':>9}")
    for r in out["whole"]:
        print(f"{r['L']:>6} whole hybrid call: cuDNN {r['cudnn_ms']:.3f} | "
              + " | ".join(f"{k_[9:]} {v_:.3f} ({r['cudnn_ms'] / v_:.2f}x)" for k_, v_ in r.items()
                           if k_.startswith("whole_ms")))
    for r in out["rows"]:
        for impl in ("old", "new", "new_qb128"):
            if impl in r:
                print(f"{r['L']:>6} {impl:>10} " + " ".join(f"{r[impl].get(c, float('nan')):>13.4f}" for c in cols)
                      + f" {r['cudnn_ms']:>9.3f}")
        if "variants" in r:
            print("       variants: " + ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in r["variants"].items()))
        if "kernels_new" in r:
            print("       kernels (cov): " + ", ".join(f"{k}={v:.4f}" for k, v in r["kernels_new"].items()))
        if "checks" in r:
            print("       checks: " + ", ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}"
                                         for k, v in r["checks"].items()))


if __name__ == "__main__":
    main()
