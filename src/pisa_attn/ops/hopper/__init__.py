"""Hopper (sm_90) kernels written in Gluon (``triton.experimental.gluon``)."""
