"""Device script of the context-parallel benchmark (:mod:`pisa_attn.bench.context_parallel`: what
it measures, its limits and its JSON; ``python benchmarks/bench_parallel.py --help``).

    NPROC=4 OUT=DIR bash benchmarks/parallel_suite.sh             # torchrun on N GPUs
    python benchmarks/bench_parallel.py --tiny                      # CPU check: 2 gloo ranks, tiny Wan
"""

import sys

from pisa_attn.bench.context_parallel import bench_rank, main, parse_args, table  # noqa: F401 (tests load them here)

if __name__ == "__main__":
    sys.exit(main())
