"""The context-parallel benchmark (pisa_attn.bench.context_parallel, benchmarks/bench_parallel.py):
how the stage limit and the run's budget cut timed forwards and the phase forward, and that the
result says so (the multi-rank run is in test_parallel_diffusers)."""

import time

import pytest
import torch

from pisa_attn.bench import context_parallel


def _module():
    return context_parallel


class Slow(torch.nn.Module):
    """A 'transformer' whose forward takes ``seconds`` (longer than the stage limit in ms)."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def forward(self, x, return_dict=False):
        time.sleep(self.seconds)
        return (x + 1,)


def _stage(mod, argv, seconds, phases=False):
    args = mod.parse_args(["--tiny", *argv])
    clock = mod.Clock(args, torch.device("cpu"))
    return mod._run_stage(Slow(seconds), {"x": torch.zeros(2)}, args, clock, alone=True, phases=phases)


def test_forwards_of_50_ms_all_run_under_a_10_s_stage_limit():
    mod = _module()  # the limit is in seconds, the times in ms: 50 (ms) must not count as 50 s
    _, times, split, limits = _stage(mod, ["--iters", "3", "--warmup", "0", "--stage-limit", "10"], 0.05, phases=True)
    assert len(times) == 3 and all(t >= 50 for t in times)
    assert limits == dict(iters_asked=3, iters_run=3, iters_cut_by=None, phases="recorded")
    assert split is not None and split["forward"] >= 50


def test_a_cut_is_recorded_and_printed():
    mod = _module()
    _, times, split, limits = _stage(mod, ["--iters", "3", "--warmup", "0", "--stage-limit", "0.06"], 0.05, phases=True)
    assert len(times) == 1 and split is None
    assert limits["iters_run"] == 1 and "--stage-limit 0.06 s" in limits["iters_cut_by"]
    assert limits["phases"].startswith("cut by the stage limit")
    _, times, _, limits = _stage(mod, ["--iters", "3", "--warmup", "0", "--total-limit", "0.06"], 0.05)
    assert len(times) == 1 and "--total-limit 0.06 s" in limits["iters_cut_by"]
    shape = dict(rows=[mod._row("pisa 1 GPU", times, limits=limits)])
    (note,) = mod.limit_notes(shape)
    assert note.startswith("pisa 1 GPU: 1 of 3 timed forwards, the run's budget")


def test_versions_are_recorded():
    import pisa_attn

    v = context_parallel._versions(torch.device("cpu"))
    assert v["pisa_attn"] == pisa_attn.__version__ and v["torch"] == torch.__version__
    assert {"diffusers", "cuda", "cudnn", "nccl", "triton"} <= set(v)


@pytest.mark.parametrize("flag, value", [
    ("--iters", "0"), ("--warmup", "-1"), ("--layers", "1"), ("--density", "0"), ("--density", "1.5"),
    ("--stage-limit", "0"), ("--total-limit", "-1"), ("--world", "0"), ("--world", "1"), ("--mode", "bogus"),
])  # fmt: skip
def test_bad_arguments_are_refused_naming_the_argument(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        context_parallel.parse_args(["--tiny", flag, value])
    assert e.value.code == 2 and f"argument {flag}" in capsys.readouterr().err
