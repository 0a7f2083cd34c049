"""Host time of one eager call (the Python and launch work a caller pays per attention call),
measured as N calls queued without synchronising, plus a cProfile of the hot path.

On a GPU: ``run`` on a plan and ``pisa_attention`` (same shape, cached plan) for each kernel
backend and mode, cuDNN SDPA in the same run, and the cProfile of ``run`` and ``pisa_attention``:

    PYTHONPATH=src python3 tests/gpu/host_profile.py [--length 4096] [--out OUT]

``--images``: the call image models make, FLUX.1-dev-shaped 1024² (B1, 24 heads x 128, 4096
image + 512 text tokens, block 64, text key blocks kept exact): ``sparse_attention`` of the
diffusers integration on its plans (eager), ``run`` with ``keep_blocks``, and cuDNN/default SDPA.

Without a GPU (``--proxy``, or no CUDA): ``run`` and ``pisa_attention`` on CPU tensors with the
kernels faked (each launcher's C entry point replaced by a logger), counting Python function
calls, launches and aten ops per call: the host work that is ours, not the driver's:

    PYTHONPATH=src python3 tests/gpu/host_profile.py --proxy
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time

import torch


def host_us(fn, n=200, sync=True):
    """(host µs per call, wall µs per call until the GPU is done) over ``n`` calls queued back to back."""
    fn()
    if sync:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    if sync:
        torch.cuda.synchronize()
    done = time.perf_counter()
    return (t1 - t0) / n * 1e6, (done - t0) / n * 1e6


def profile(fn, n=200, top=25) -> tuple[str, int]:
    """cProfile of ``n`` calls: the top entries by own time, and Python function calls per call."""
    fn()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    st = pstats.Stats(pr)
    calls = st.total_calls // n
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue(), calls


def aten_ops(fn) -> list[str]:
    from torch.utils._python_dispatch import TorchDispatchMode

    ops = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return ops


def gpu(length: int, out_dir: str):
    from pisa_attn import PisaSettings, pisa_attention, plan, run

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 16, length, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "length": length, "shape": "B2-H16-D128"}
    import triton

    res["triton"] = triton.__version__
    import pisa_attn.attention as attention

    for backend in ("hopper", "triton"):
        for case, mode, cov in (("topk", "hybrid", False), ("cov", "hybrid", True), ("drop", "drop", False)):
            s = PisaSettings(density=0.125, mode=mode, backend=backend, covariance_aware=cov)
            p = plan(q, k, s)
            out = torch.empty_like(q)
            calls = {
                "run": lambda: run(p, q, k, v),
                "run_out": lambda: run(p, q, k, v, out=out),
                "pisa_attention_settings": lambda: pisa_attention(q, k, v, settings=s),
                "pisa_attention": lambda: pisa_attention(q, k, v, density=0.125, mode=mode, backend=backend,
                                                         covariance_aware=cov),
            }
            for name, fn in calls.items():
                host, wall = host_us(fn)
                res[f"{backend}_{case}_{name}"] = dict(host_us=host, wall_us=wall)
                print(f"{backend:6s} {case:5s} {name:24s} L={length}: host {host:7.1f} us/call, wall {wall:7.1f} "
                      f"us/call", flush=True)
            # the replayed launches against the checked path: the same bits
            fast = run(p, q, k, v, return_lse=True)
            bound_run, attention._bound_run = attention._bound_run, lambda *a, **kw: None
            try:
                slow = run(p, q, k, v, return_lse=True)
            finally:
                attention._bound_run = bound_run
            torch.cuda.synchronize()
            same = bool(torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1]))
            progs = [x for x in p.programs.values() if isinstance(x, attention._Program)]
            res[f"{backend}_{case}_replay_bit_identical"] = same
            res[f"{backend}_{case}_programs"] = len(progs)
            print(f"{backend} {case}: replay bit-identical to the checked path: {same}; {len(progs)} programs",
                  flush=True)
            if backend == "hopper" and case == "topk" and progs:
                print(progs[0].replay.source, flush=True)
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)  # noqa: E731
    host, wall = host_us(sdpa)
    res["sdpa"] = dict(host_us=host, wall_us=wall)
    print(f"sdpa (default backend): host {host:7.1f} us/call, wall {wall:7.1f}", flush=True)
    p = plan(q, k, PisaSettings(density=0.125))
    for name, fn in (("run", lambda: run(p, q, k, v)), ("pisa_attention", lambda: pisa_attention(q, k, v))):
        text, n_calls = profile(fn)
        torch.cuda.synchronize()
        res[f"python_calls_per_{name}"] = n_calls
        print(f"--- cProfile of {name} (backend {p.backend}): {n_calls} Python calls per call")
        print(text[:6000])
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"host_profile_{length}.json"), "w") as f:
        json.dump(res, f, indent=1)


def flux_call(device, dtype=torch.bfloat16):
    """A FLUX.1-dev-shaped 1024² joint self-attention call as the integration makes it: q/k/v
    ``[B, L, H, D]`` in tiled order, the sequence (text key blocks kept exact) and bshd settings."""
    from pisa_attn.bench import dit_cases as dc
    from pisa_attn.bench.e2e.backends import sequence
    from pisa_attn.settings import PisaSettings

    case = dc.CASES["flux-1024"]
    seq = sequence(case, 64).joint
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, seq.length, case.heads, case.head_dim, generator=g).to(device, dtype) for _ in range(3))
    settings = PisaSettings(density=case.density, covariance_aware=True, layout="bshd",
                            backend="triton" if device == "cpu" else "auto")
    return q, k, v, seq, settings


def image_calls(q, k, v, seq, settings) -> dict:
    """name -> call: the integration's sparse call (its plans kept as apply_pisa keeps them), run
    with keep_blocks, and dense SDPA on the same tensors."""
    from pisa_attn import plan, run
    from pisa_attn.diffusers.calls import sparse_attention

    plans: dict = {}
    keep = seq.keep_for(k.shape[1], 64)
    p = plan(q, k, settings, max_keep=int(keep.sum()))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    return {
        "sparse_attention": lambda: sparse_attention(q, k, v, seq, None, settings, plans=plans),
        "run_keep": lambda: run(p, q, k, v, keep_blocks=seq.keep_for(k.shape[1], 64)),
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt),
    }


def images_gpu(out_dir: str):
    import triton

    q, k, v, seq, settings = flux_call("cuda")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "shape": f"FLUX.1-dev 1024^2: B1-H24-L{q.shape[1]}-D128 bf16, {seq.text_len} text tokens kept exact, "
                    f"density {settings.density}, covariance-aware"}
    for name, fn in image_calls(q, k, v, seq, settings).items():
        for _ in range(3):
            fn()  # compile, record, replay
        host, wall = host_us(fn)
        text, n_calls = profile(fn)
        torch.cuda.synchronize()
        res[name] = dict(host_us=host, wall_us=wall, python_calls=n_calls)
        print(f"flux-1024 {name:18s}: host {host:7.1f} us/call, wall {wall:7.1f} us/call, {n_calls} Python calls",
              flush=True)
        if name == "sparse_attention":
            print(text[:4000], flush=True)
    # the image queries' PISA call (text key blocks kept) in a compiled graph (one registered op),
    # against the same call eager
    import pisa_attn.attention as attention
    from pisa_attn import pisa_attention

    keep = seq.keep_for(k.shape[1], 64)
    qi = q[:, seq.image_lo // 64 * 64:]
    eager = pisa_attention(qi, k, v, settings=settings, keep_blocks=keep)
    fn = torch.compile(lambda q, k, v: pisa_attention(q[:, seq.image_lo // 64 * 64:], k, v, settings=settings,
                                                      keep_blocks=keep), fullgraph=True)
    host, wall = host_us(lambda: pisa_attention(qi, k, v, settings=settings, keep_blocks=keep))
    res["pisa_attention_keep"] = dict(host_us=host, wall_us=wall)
    print(f"flux-1024 pisa_attention keep (eager): host {host:7.1f} us/call, wall {wall:7.1f} us/call", flush=True)
    try:
        for _ in range(3):
            got = fn(q, k, v)
        host, wall = host_us(lambda: fn(q, k, v))
    except Exception as e:  # report it with the eager numbers rather than lose them
        res["pisa_attention_keep_compiled"] = f"failed: {type(e).__name__}: {e}"[:500]
        print(res["pisa_attention_keep_compiled"], flush=True)
        host = None
    if host is not None:
        err = float((got.float() - eager.float()).abs().mean() / eager.float().abs().mean())
        progs = sum(isinstance(x, attention._Program) for p in getattr(attention, "_OP_PLANS", {}).values()
                    for x in p.programs.values())
        res["pisa_attention_keep_compiled"] = dict(host_us=host, wall_us=wall, rel_l1_vs_eager=err, op_programs=progs)
        print(f"flux-1024 pisa_attention keep (compiled): host {host:7.1f} us/call, wall {wall:7.1f} us/call, "
              f"rel-L1 vs eager {err:.2e}, recorded op programs {progs}", flush=True)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "host_profile_images.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


def images_proxy():
    """The FLUX-shaped call without a GPU (kernels faked, as :func:`proxy`)."""
    import sys

    os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from fake_launch import fake_kernels

    q, k, v, seq, settings = flux_call("cpu")
    with fake_kernels() as log:
        for name, fn in image_calls(q, k, v, seq, settings).items():
            if name == "sdpa":
                continue
            for _ in range(3):
                fn()
            del log[:]
            ops = aten_ops(fn)
            launches = len(log)
            host, _ = host_us(fn, n=500, sync=False)
            text, n_calls = profile(fn)
            print(f"flux-1024 {name}: {n_calls} Python function calls, {launches} launches, {len(ops)} aten ops "
                  f"{ops}, {host:.1f} us/call (CPU, kernels faked)")
        print(text[:2500])


def proxy(length: int):
    """The host path without a GPU: CPU tensors, kernels faked (tests/fake_launch.py: every launch
    goes through its launcher, recorded runs replay, nothing runs on a device)."""
    import sys

    os.environ.setdefault("TRITON_INTERPRET", "1")  # lets the Triton backend be planned for CPU tensors
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from fake_launch import fake_kernels

    from pisa_attn import PisaSettings, pisa_attention, plan, run

    q, k, v = (torch.randn(2, 16, length, 128).to(torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    with fake_kernels() as log:
        for cov in (False, True):
            s = PisaSettings(backend="triton", covariance_aware=cov)
            p = plan(q, k, s)
            for name, fn in (("run", lambda: run(p, q, k, v)), ("run_out", lambda: run(p, q, k, v, out=out)),
                             ("pisa_attention", lambda: pisa_attention(q, k, v, settings=s))):
                for _ in range(3):
                    fn()  # compile (faked), record, replay
                del log[:]
                ops = aten_ops(fn)
                launches = len(log)
                host, _ = host_us(fn, n=2000, sync=False)
                text, n_calls = profile(fn)
                print(f"{'cov' if cov else 'topk'} {name}: {n_calls} Python function calls, {launches} launches, "
                      f"{len(ops)} aten ops {ops}, {host:.1f} us/call (CPU, kernels faked)")
        print(text[:2500])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--proxy", action="store_true", help="the CPU proxy (meta tensors, launches stubbed)")
    ap.add_argument("--images", action="store_true", help="the FLUX-shaped image call (see the module docstring)")
    a = ap.parse_args()
    if a.images:
        images_proxy() if a.proxy or not torch.cuda.is_available() else images_gpu(a.out)
    elif a.proxy or not torch.cuda.is_available():
        proxy(a.length)
    else:
        gpu(a.length, a.out)


if __name__ == "__main__":
    main()
