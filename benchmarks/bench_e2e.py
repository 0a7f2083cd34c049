"""Device script of the paper-scale end-to-end benchmark (``bash benchmarks/run_e2e.sh``).

What it measures, its stages, budgets and the device-time plan: :mod:`pisa_attn.bench.e2e`
(``python benchmarks/bench_e2e.py --help``; ``--estimate`` prints the estimated device time without a GPU).

    bash benchmarks/run_e2e.sh all                      # one device call, carry .whl (diffusers)
    python benchmarks/bench_e2e.py --tiny --part all    # CPU check of every code path
"""

import sys

from pisa_attn.bench.e2e.main import main

if __name__ == "__main__":
    sys.exit(main())
