"""Fitting the first-order weight during a run's dense warm-up (``apply_pisa(..., calibrate=True)``).

Warm-up steps run dense attention in every layer, so the answer the weight is fitted against is
there. On each warm-up call of a layer that will later run sparse, :class:`Calibrator` (an observer
of the managed calls) samples a few query rows, the same positions in every batch row (so a sample's
weights do not depend on its place in the batch), and computes on those rows only, in float32, the
zeroth-order output, the first-order correction and the dense output
(:func:`pisa_attn.calibration.fit_rows`); it adds their least-squares statistics per layer and head,
under both selection rules (top-k and covariance-aware; :func:`pisa_attn.calibration.fit_rules`, one
dense pass of the rows). The first sparse call of a generation freezes the weights and the rules:
per layer the rule whose clamped fit (:data:`pisa_attn.calibration.FIT_BOUNDS`) leaves the smaller
squared error, and its weights per head; a layer without samples keeps the weight and rule it has
without calibration. Each generation fits anew, on its own warm-up (the input being generated is the
best calibration input there is).

Cost per calibrated call: the key statistics (``O(Lk·D²)`` per head, as PISA's prepare, plus the
covariance deviations) and one pass of the sampled rows over the keys, against the call's
``O(Lq·Lk·D)`` dense attention, with no value read back to the host. On CUDA with
float16/bfloat16 inputs a call is the Triton fit (:mod:`pisa_attn.ops.triton.fit`: the kernels'
prepare and select stages, one kernel for the rows' dense and per-rule sums over key chunks, one
merge), launched directly on q, k and v in place (:class:`pisa_attn.calibration.FitGraphs`,
shared by the process: :data:`GRAPHS`) on a side stream that overlaps the model's next operations
(``CalibrationConfig.side_stream``); other inputs run the reference arithmetic, one CUDA graph
per call shape on a GPU. H100, bf16, 32 rows, both rules: 0.30 ms of device time per Wan2.1-1.3B
480p call (+1.3% on a dense warm-up step), 0.14 ms per FLUX.1 1024² call (+3.8%; one rule +3.4%;
+5.7% on the model's own stream; ``benchmarks/calibration_cost.py``,
``benchmarks/results/h100_calibration_cost.json``).
"""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import calibration as cal
from .. import spec
from ..alpha_table import AlphaTable, from_fits
from ..layout import block_floor
from . import hooks
from .schedule import Schedule


@dataclass(frozen=True)
class CalibrationConfig:
    """rows: query rows sampled per warm-up call and layer, shared out over the batch rows (runs of
    up to :data:`CHUNK` consecutive rows in distinct random query blocks: a block's rows share its
    exact set).
    fit: ``"head"`` (a weight per head) or ``"layer"`` (one per layer).
    seed: the sampling's seed (each generation samples from it anew: the same input gives the same
    weights).
    choose_selection: also choose each layer's selection rule (top-k or covariance-aware), the
    one whose fitted weights leave the smaller squared error on the sampled rows; both are fitted
    from one dense pass of the rows (:func:`pisa_attn.calibration.fit_rules`).
    cuda_graphs: on CUDA, where the Triton fit does not apply (float32 inputs, ``mode="first"``),
    run each call shape's reference fit as one captured CUDA graph
    (:class:`pisa_attn.calibration.FitGraphs`; the same arithmetic, a few launches per call instead
    of a couple of hundred); False runs it op by op. The Triton fit is launched directly either way.
    side_stream: on CUDA, where the Triton fit applies, run each call's fit on a side stream of the
    calibrator's, so that it overlaps the model's next operations (the fit only reads q, k and v);
    the fits are joined to the model's stream when they are read (:attr:`Calibrator.fits`: the
    table, the frozen weights). The sums are the same bit for bit; on the CPU there are no
    streams and this changes nothing."""

    rows: int = 32
    fit: str = "head"
    seed: int = 0
    choose_selection: bool = True
    cuda_graphs: bool = True
    side_stream: bool = True

    def __post_init__(self):
        n = self.rows
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"rows must be a positive int, got {n!r}")
        if self.fit not in cal.FIT_OVER:
            raise ValueError(f"fit must be one of {cal.FIT_OVER}, got {self.fit!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__}")
        if not isinstance(self.choose_selection, bool):
            raise TypeError(f"choose_selection must be True or False, got {self.choose_selection!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise TypeError(f"cuda_graphs must be True or False, got {self.cuda_graphs!r}")
        if not isinstance(self.side_stream, bool):
            raise TypeError(f"side_stream must be True or False, got {self.side_stream!r}")


CHUNK = 16

GRAPHS = cal.FitGraphs()
"""The captured fits of this process (per call shape; shared by every calibrated model, so a new
``apply_pisa`` or generation of the same shapes captures nothing)."""


def sample_rows(rng: random.Random, lo: int, hi: int, block_size: int, rows: int) -> list[int]:
    """About ``rows`` positions in ``[lo, hi)``: runs of up to :data:`CHUNK` consecutive rows, each
    in its own query block (blocks of ``block_size`` rows counted from 0), blocks drawn at random;
    longer runs where there are too few blocks for ``rows`` in runs of :data:`CHUNK`."""
    if rows >= hi - lo:
        return list(range(lo, hi))
    first, last = lo // block_size, (hi - 1) // block_size
    chunk = min(block_size, max(CHUNK, -(-rows // (last - first + 1))))
    blocks = rng.sample(range(first, last + 1), min(last - first + 1, -(-rows // chunk)))
    out = []
    for i in sorted(blocks):
        a, e = max(lo, i * block_size), min(hi, (i + 1) * block_size)
        start = a + rng.randrange(max(1, e - a - chunk + 1))
        out.extend(range(start, min(e, start + chunk)))
    return out


def as_config(value) -> CalibrationConfig | None:
    """``calibrate=``: ``True`` (the defaults), ``False`` (off) or a :class:`CalibrationConfig`."""
    if isinstance(value, CalibrationConfig):
        return value
    if value is True:
        return CalibrationConfig()
    if value is False or value is None:
        return None
    raise TypeError(f"calibrate must be True, False or a CalibrationConfig, got {value!r}")


class Calibrator:
    """Per-layer fits of one transformer's warm-up calls (see the module docstring)."""

    def __init__(self, config: CalibrationConfig, schedule: Schedule, default=spec.DEFAULT_ALPHA):
        self.config = config
        self.schedule = schedule
        # the weight of a head no fitted row gives a tail: the run's alpha (a float or one per head)
        self.default = tuple(float(x) for x in default) if isinstance(default, tuple) else float(default)
        self.rng = random.Random(config.seed)
        # layer -> [rules, 4, H] running sums (cal.SUMS) on the device, rows, elements
        self._sums: dict[int, list] = {}
        self._rules: tuple[bool, ...] = ()
        self.settings: dict = {}
        self.frozen: dict[int, Tensor] | None = None
        self.frozen_rules: dict[int, bool] | None = None
        self.calls = 0  # calibrated calls this generation
        self._last_step = -1
        self._remove = None
        self._streams: dict = {}  # device -> the side stream its fits run on
        self._pending: set = set()  # devices whose side stream has fits the model's stream has not joined

    def attach(self, transformer) -> None:
        self._remove = hooks.add_observer(transformer, self.observe)

    def detach(self) -> None:
        if self._remove is not None:
            self._remove()
            self._remove = None

    def reset(self) -> None:
        """A new generation: forget the fits and the frozen weights."""
        self.join()
        self._sums.clear()
        self.rng = random.Random(self.config.seed)
        self.frozen = None
        self.frozen_rules = None
        self.calls = 0
        self._last_step = -1

    @torch.no_grad()
    @torch.inference_mode(False)  # its sums and graphs outlive the call: plain tensors under either mode
    def observe(self, call: hooks.AttentionCall) -> None:
        if call.step < self._last_step:  # a generation the pipeline hook did not announce
            self.reset()
        self._last_step = call.step
        if self.frozen is not None or not call.dense or call.meta.get("dense_reason") != "warmup_step":
            return
        if call.mode not in spec.FIRST_ORDER_MODES:
            return
        lens = call.meta.get("key_lens")
        bs = call.block_size
        lo, hi = call.meta.get("image_range") or (0, call.q.shape[2])
        start = block_floor(lo, bs)  # the query blocks the backend runs (see layout.block_floor)
        # the same positions in every batch row: a sample's fit does not depend on its place in the batch
        share = -(-self.config.rows // call.q.shape[0])
        rows = sample_rows(self.rng, lo - start, hi - start, bs, share)[:share]  # runs are whole chunks: cut
        plan = cal.row_plan(hi - start, bs, rows, (lo - start, hi - start))
        rules = (False, True) if self.config.choose_selection else (bool(call.covariance_aware),)
        fit = dict(density=call.density, rules=rules, mode=call.mode, scale=call.scale, block_size=bs,
                   capture=self.config.cuda_graphs)
        block = call.meta.get("block", call.layer)
        side = self._side_stream(call.q, call.k, call.mode, bs)
        fitted = 0
        for b in range(call.q.shape[0]):
            n = call.k.shape[2] if not lens else int(lens[b])
            # A layer that never runs sparse (a dense layer, too few keys) needs no weight. The sparse
            # calls decide on the padded key count, so this does too (not on the row's valid keys).
            if self.schedule.dense_reason(block, 1 << 62, call.k.shape[2]) is not None:
                continue
            # An all-False mask selects as None does: no device read to find out.
            keep = None if call.keep_blocks is None else call.keep_blocks[: spec.num_blocks(n, bs)]
            q = call.q[b : b + 1, :, start:hi]
            k, v = call.k[b : b + 1, :, :n], call.v[b : b + 1, :, :n]
            keep = GRAPHS.on_device(keep, q.device)  # a host tensor is copied once, on the model's stream
            prev = self._sums.get(call.layer)
            if prev is None:
                prev = self._sums[call.layer] = [torch.zeros(len(rules), 4, q.shape[1], device=q.device,
                                                             dtype=torch.float64), 0, 0]
            if side is None:
                self.join()  # earlier fits on a side stream add into the same sums
                prev[0].add_(GRAPHS.sums(q, k, v, plan, keep_blocks=keep, **fit))  # add: a graph's output is reused
            else:
                side.wait_stream(torch.cuda.current_stream(q.device))
                with torch.cuda.stream(side):
                    prev[0].add_(GRAPHS.sums(q, k, v, plan, keep_blocks=keep, **fit))
                # made on the model's stream and read on the side one: not reused before the fit is done
                for t in (q, k, v, prev[0]) + (() if keep is None else (keep,)):
                    t.record_stream(side)
                self._pending.add(q.device)
            r = len(plan.pos)
            prev[1] += r
            prev[2] += r * q.shape[3]
            fitted += 1
        if not fitted:
            return
        self.calls += 1
        self.settings = {"density": call.density, "mode": call.mode, "covariance_aware": call.covariance_aware,
                         "block_size": bs}
        self._rules = rules

    def _side_stream(self, q: Tensor, k: Tensor, mode: str, block_size: int):
        """The side stream a call's fit runs on, or None (the model's stream): CUDA, the Triton fit
        (the CUDA-graph path captures and replays on the model's stream), not while compiling."""
        if (not self.config.side_stream or not q.is_cuda or torch.compiler.is_compiling()
                or not cal.fast_fit_supported(q, mode, block_size, kv_len=k.shape[2])):
            return None
        side = self._streams.get(q.device)
        if side is None:
            side = self._streams[q.device] = torch.cuda.Stream(q.device)
        return side

    def join(self) -> None:
        """Make the model's stream wait for the fits enqueued on side streams (no host
        synchronisation): what reads the running sums comes after this."""
        for dev in self._pending:
            torch.cuda.current_stream(dev).wait_stream(self._streams[dev])
        self._pending.clear()

    @property
    def fits(self) -> dict[int, dict[bool, cal.RowFit]]:
        """``{layer: {selection rule: pooled RowFit}}`` of this generation's calibrated calls."""
        self.join()
        return {layer: cal.row_fits(s, self._rules, rows=r, elems=e) for layer, (s, r, e) in self._sums.items()}

    def freeze(self) -> dict[int, Tensor]:
        """The weights of this generation (fitted now on the first call, then kept): ``{layer:
        CPU float64 [H]}`` for the layers that were sampled."""
        if self.frozen is None:
            if self.calls == 0:
                warnings.warn("calibrate=True: no dense warm-up call of this transformer was sampled this generation "
                              "(e.g. Wan2.2's low-noise expert runs only after the warm-up steps), so its sparse calls "
                              "keep the weights they have without calibration: raise dense_steps past the switch, or "
                              "load fitted weights with alpha_table=", RuntimeWarning, stacklevel=2)
            table = self.table()
            self.frozen = {i: torch.tensor(x.alpha, dtype=torch.float64) for i, x in table.layers().items()}
            self.frozen_rules = {i: table.covariance_aware(i) for i in table.layers()}
        return self.frozen

    def selection(self) -> dict[int, bool]:
        """``{layer: covariance_aware}`` chosen this generation (frozen with the weights)."""
        self.freeze()
        return dict(self.frozen_rules or {})

    def table(self, name: str = "transformer") -> AlphaTable:
        """The current fits as a table (the weights, selection rule, tail mass and rows per layer)."""
        fits, rules = cal.choose_rules({name: self.fits}, over=self.config.fit, default=self.default,
                                       require_tail=False)
        return from_fits(fits, settings=self.settings, over=self.config.fit, default=self.default,
                         source="calibrate=True (dense warm-up)", rules=rules if self.config.choose_selection else None)
