"""pisa-attn: Piecewise Sparse Attention (PISA) for diffusion transformers."""

from .attention import PisaPlan, make_plan, pisa_attention, run

__version__ = "0.1.0"
__all__ = ["pisa_attention", "PisaPlan", "make_plan", "run", "__version__"]
