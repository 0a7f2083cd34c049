"""Reading an end-to-end measurement: the Amdahl bound of a forward whose attention gets faster,
the paper's warm-up schedule as a weighted multi-step estimate, and FLOP-based time estimates
that plan device time before anything is measured.
"""

from __future__ import annotations

from .dit_cases import Case

# Planning rates (one H100; replaced by measurements as soon as a stage has them).
ATTENTION_FLOPS = 600e12  # dense attention, bf16, long sequences (cuDNN)
GEMM_FLOPS = 600e12  # the linear layers
# Norms, modulation, RoPE, activations: seconds per (token x channel x block), from Wan2.1-1.3B
# 480p on an H100 (forward without self-attention 304 ms of which GEMMs 137 ms).
ELEMENTWISE_S = 1.07e-10
PISA_RATIO = 4.0  # attention-call speed-up assumed before it is measured
# Whole-model torch.compile (inductor), one variant: a guess to be replaced by the first measurement.
COMPILE_BASE_S = 20.0
COMPILE_BLOCK_S = 1.5


def amdahl_bound(t_dense: float, t_rest: float, ratio: float) -> float:
    """Speed-up of a forward taking ``t_dense`` when its attention (``t_dense - t_rest``) runs
    ``ratio`` times faster and nothing else changes."""
    if t_dense <= 0 or t_rest < 0 or ratio <= 0:
        raise ValueError(f"need t_dense > 0, t_rest >= 0, ratio > 0; got {t_dense}, {t_rest}, {ratio}")
    attention = max(t_dense - t_rest, 0.0)
    return t_dense / (t_rest + attention / ratio)


def schedule_speedup(
    t_dense: float,
    t_sparse: float,
    *,
    steps: int,
    dense_steps: int,
    dense_layers: int,
    dense_layer_extra: float = 0.0,
    dense_step_extra: float = 0.0,
) -> dict:
    """A generation of ``steps`` transformer forwards under a warm-up schedule, from one dense and
    one all-sparse forward time.

    ``dense_layer_extra``: what one warm-up layer adds to a sparse forward (its dense attention
    call minus its sparse one). ``dense_step_extra``: what a warm-up step of the PISA-managed
    model costs beyond ``t_dense`` (its dense calls take PISA's dense path, not the baseline's).
    Returns the per-forward times of both kinds of step, the totals and the speed-up.
    """
    if not 0 <= dense_steps <= steps or steps < 1 or dense_layers < 0:
        raise ValueError(
            f"need 0 <= dense_steps <= steps, steps >= 1, dense_layers >= 0; got {dense_steps}, {steps}, {dense_layers}"
        )
    warm_step = t_dense + dense_step_extra
    sparse_step = t_sparse + dense_layers * dense_layer_extra
    pisa = dense_steps * warm_step + (steps - dense_steps) * sparse_step
    dense = steps * t_dense
    if warm_step <= 0 or sparse_step <= 0:
        # the extras are differences of isolated calls: at tiny sizes their noise can exceed a forward
        return {"steps": steps, "dense_steps": dense_steps, "dense_layers": dense_layers, "dense_step_ms": warm_step,
                "sparse_step_ms": sparse_step, "speedup": None,
                "note": "a step's estimate is not positive (the call differences are below their noise)"}
    return {
        "steps": steps,
        "dense_steps": dense_steps,
        "dense_layers": dense_layers,
        "dense_step_ms": warm_step,
        "sparse_step_ms": sparse_step,
        "dense_total_ms": dense,
        "pisa_total_ms": pisa,
        "speedup": dense / pisa,
    }


# --- planning ------------------------------------------------------------------------------------
def forward_flops(case: Case) -> dict:
    """FLOPs of one transformer forward: ``attention`` (managed self-attention, 4 L^2 H D per
    layer), ``cross`` (Wan's text cross-attention) and ``linear`` (2 per weight per token)."""
    h = case.heads * case.head_dim
    n_img, text, cfg = case.image_tokens, case.text, case.config
    if case.family == "wan":
        layers = cfg["num_layers"]
        per_token = 6 * h * h + 2 * h * cfg["ffn_dim"]  # self q k v o, cross q o, FFN
        linear = 2 * layers * (n_img * per_token + text * 2 * h * h)  # cross k v on the prompt
        return {"attention": 4 * n_img**2 * h * layers, "cross": 4 * n_img * text * h * layers, "linear": linear}
    double, single = cfg["num_layers"], cfg.get("num_single_layers", 0)
    n = n_img + text
    per_token = 12 * h * h  # attention projections 4 h^2 + MLP (ratio 4) 8 h^2, both block kinds
    linear = 2 * per_token * (double * (n_img + text) + single * n)
    return {"attention": 4 * n * n * h * (double + single), "cross": 0, "linear": linear}


def forward_seconds(case: Case, ratio: float = PISA_RATIO) -> dict:
    """Estimated seconds of one forward: ``dense``, ``pisa`` (attention ``ratio`` times faster),
    ``rest`` (without self-attention) and ``attention``."""
    f = forward_flops(case)
    h = case.heads * case.head_dim
    tokens = case.image_tokens + case.joint_text
    rest = f["linear"] / GEMM_FLOPS + f["cross"] / ATTENTION_FLOPS + ELEMENTWISE_S * tokens * h * case.blocks
    attention = f["attention"] / ATTENTION_FLOPS
    return {"dense": rest + attention, "pisa": rest + attention / ratio, "rest": rest, "attention": attention}


def compile_seconds(blocks: int) -> float:
    """Estimated seconds of one whole-model inductor compile of a ``blocks``-block transformer."""
    return COMPILE_BASE_S + COMPILE_BLOCK_S * blocks
