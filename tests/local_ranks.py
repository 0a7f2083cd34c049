"""Test-only: the gloo rank groups of the context-parallel tests fork from one server per test
process instead of each starting a fresh interpreter. A fresh rank spends most of its life
importing torch and diffusers (about 10 s of CPU each on a two-core CI machine); the server
imports them once. It never runs an op itself, so forking it is safe."""

from __future__ import annotations

import multiprocessing

from pisa_attn.parallel.launch import run_local

# Imported once by the server (a module that fails to import is skipped there and imported by the
# rank that needs it); interpreter_patch first, so that ranks interpret kernels as the suite does.
# diffusers' own modules only, never pisa_attn.diffusers: a rank that checks pisa_attn leaves
# diffusers untouched must find it as diffusers made it.
PRELOAD = [
    "interpreter_patch", "torch", "torch.distributed", "pisa_attn", "pisa_attn.parallel", "diffusers",
    "diffusers.models.transformers.transformer_flux", "diffusers.models.transformers.transformer_wan",
    "diffusers.hooks.context_parallel", "diffusers_tiny",
]


def run_ranks(fn, world_size: int, *args):
    """:func:`run_local` on ranks forked from this process's preloaded server."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    return run_local(fn, world_size, *args, start_method="forkserver")
