"""Operators: ``reference`` (PyTorch, the statement of the math) and ``triton`` (fused GPU kernels)."""
