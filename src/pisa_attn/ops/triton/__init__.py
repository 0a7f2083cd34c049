"""Fused Triton kernels for PISA: ``prepare`` (block statistics), ``select`` (fused top-k),
``attention`` (Algorithm 1), registered as ``torch.ops.pisa_attn.pisa_fwd`` by ``op``."""
