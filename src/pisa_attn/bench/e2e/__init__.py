"""PISA in diffusers transformers at the paper's scale: one transformer forward, dense vs PISA, same run.

Each case builds the REAL transformer config with random weights (bf16, on the GPU) and times ONE
forward on the fastest dense diffusers backend (cuDNN SDPA via ``_native_cudnn`` where it runs;
every native backend is timed on one attention call at the model's exact shape and the fastest
one runs the dense forward) and on PISA at the paper's density with no warm-up
(``dense_layers=0, dense_steps=0``; ``--min-kv-len 0`` makes every managed call sparse, otherwise the
library's ``min_kv_len`` default keeps short sequences dense):

=================  ======================================  ========================  =========  ========
case               model, size                             tokens (self-attention)   density    warm-up
=================  ======================================  ========================  =========  ========
wan14b-720p        Wan2.1-14B, 720p 81 frames              21x45x80 = 75 600         12.5 %     1 / 10
hunyuan-720p       HunyuanVideo 13B, 720p 129 frames       33x45x80 = 118 800 + 256  12.5 %     1 / 10
flux-1024          FLUX.1-dev, 1024x1024                   64x64 = 4 096 + 512       15 %       4 / 0
flux-2048          FLUX.1-dev, 2048x2048                   128x128 = 16 384 + 512    15 %       4 / 0
wan1.3b-480p       Wan2.1-1.3B, 480p 81 frames             21x30x52 = 32 760         12.5 %     1 / 15
sd35-1024          SD3.5-Large, 1024x1024                  64x64 = 4 096 + 333       15 %       4 / 0
=================  ======================================  ========================  =========  ========

(warm-up: dense transformer blocks / dense steps of 50, the paper's appendix D.) Per case:

* **speed-up** of the PISA forward over the dense one, and its **share of the Amdahl bound**
  ``T_dense / (T_rest + (T_dense - T_rest) / r)``: ``T_rest`` is the forward with the managed
  self-attention calls replaced by an opaque op that returns an uninitialised tensor (its inputs
  are still computed, so nothing around attention is optimised away), ``r`` the attention call's
  own speed-up at the model's exact shape (dense backend vs PISA's sparse path, text handling
  included).
* **the paper's schedule** as a weighted 50-step estimate from the measured forwards (warm-up
  steps dense; the warm-up layers' calls at their measured dense cost), beside the paper's own
  end-to-end numbers (whole generations against its own dense baseline).
* **boundary cost**: the forward with PISA's tiling hooks and no attention minus the forward with
  no attention (permutations, run bookkeeping), and the gathers alone timed at the model's
  shapes, as % of the PISA forward (target < 3 %).
* **output**: rel-L1 (``mean|a - b| / mean|b|``) of PISA vs dense; in the compiled stages also
  compiled vs eager, for dense and PISA (does compiling move dense as much as it moves PISA?).

Stages (``--part`` or ``--stages``), in order of value; each has its own time budget (``--budget-s``)
and is skipped or cut cleanly when it would overrun it or the run's (``--total-budget-s``):
``wan14b``, ``hunyuan`` (eager), ``wan14b-compiled``, ``hunyuan-compiled``, ``flux`` (eager, both
sizes, plus the attention-call sweep that explains ``min_kv_len``), ``wan1.3b``, ``wan1.3b-compiled``,
``flux-compiled``, ``sd35``, ``sd35-compiled``. Compiled stages run ``torch.compile(transformer, fullgraph=True)`` (compile time
reported separately) on a share of the blocks (``--fraction``; default 0.1 for the 13-14B models and
FLUX, all 30 blocks for Wan-1.3B, where compile drift is the question): per-block cost is uniform,
so ratios hold and per-forward times are extrapolated (marked ``*``, ``derived.blocks`` in the JSON).
``--fraction wan14b=0.5`` is how an eager stage builds fewer blocks when a dense forward is too slow.

Estimated device time on one H100 (``--estimate`` prints it for the chosen stages, no GPU needed):
attention 4 L^2 H D per layer and the GEMMs at 600 TFLOP/s, elementwise work calibrated on
Wan-1.3B; whole-model compiles a guess of 20 s + 1.5 s per block each, replaced by the first
measured one (``e2e_estimates``). Budgets (``--budget-s``) are the defaults:

=================  =====================================================  ========  ======
stage              what dominates                                         estimate  budget
=================  =====================================================  ========  ======
wan14b             dense forward 12.5 s (4.7 PFLOP of attention) x2,      ~75 s     130 s
                   PISA ~6.7 s x2, no-attention 4.7 s x4, calls ~10 s
                   (first stage: also the PISA kernels' first compile)
hunyuan            dense 22.5 s (10.5 PFLOP) x2, PISA ~9.4 s x2,          ~105 s    150 s
                   no-attention 5.0 s x4, calls ~14 s
wan14b-compiled    3 compiles of 4 blocks (~26 s each) + forwards         ~100 s    110 s
hunyuan-compiled   3 compiles of 6 blocks (~29 s each) + forwards         ~115 s    120 s
flux               2 sizes x 4 kinds of forward (0.2-1 s), call sweep     ~30 s     60 s
wan1.3b            4 kinds of forward x ~0.6 s                            ~10 s     40 s
wan1.3b-compiled   3 compiles of 30 blocks (~65 s each): compile drift    ~205 s    200 s
flux-compiled      2 sizes x 3 compiles of 6 blocks (2048 first)          ~185 s    110 s
sd35               4 kinds of forward (~0.2 s)                            ~15 s     50 s
sd35-compiled      3 compiles of 4 blocks + forwards                      ~90 s     110 s
=================  =====================================================  ========  ======

One 10-minute device call (``--part all``, run budget 540 s) gets everything down to ``wan1.3b``
(~7.5 min) and what fits of ``wan1.3b-compiled``; a second call runs the rest
(``--stages wan1.3b-compiled,flux-compiled``, ~6.5 min). ``--part eager`` (~4 min) and
``--part compiled`` split the same work the other way.

Device (diffusers travels as a wheel; the device has torch, triton, transformers, accelerate,
safetensors)::

    mkdir -p .whl && python -m pip download --no-deps --only-binary=:all: diffusers==0.42.1 -d .whl
    bash benchmarks/run_e2e.sh all          # one device call, carry .whl
    bash benchmarks/run_e2e.sh compiled --stages wan1.3b-compiled,flux-compiled   # the rest

CPU check of every code path with tiny models of the same classes::

    python benchmarks/bench_e2e.py --tiny --part all

Writes ``<name>.json`` (default ``bench_e2e``) to ``--out`` (default ``$OUT`` or ``./out``) after
every step, so a cut run keeps what it measured, and prints a table last.

Modules: :mod:`.stages` (stages, budgets, command line, time estimate), :mod:`.runner` (stage alarm, clock,
timed calls), :mod:`.backends` (dense / PISA / no-attention variants of a model), :mod:`.measure`
(attention calls, gathers, eager and compiled forwards), :mod:`.report` (derived numbers, table),
:mod:`.main` (the run). ``tests/test_bench_e2e.py`` runs every path on the CPU with tiny models.
"""
