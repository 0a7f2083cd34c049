"""Operators behind one stage contract (``stages``): ``reference`` (PyTorch, the statement of the
math) and ``triton`` (fused GPU kernels), plus the shared ``selection`` type and LSE ``merge``."""
