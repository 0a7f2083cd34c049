"""Portable Triton kernels for PISA: ``prepare`` (block statistics), ``select`` (fused top-k),
``pairs`` (the two-query-block stream of the Hopper kernel), ``attention`` (Algorithm 1); ``op``
is the backend built from them."""
