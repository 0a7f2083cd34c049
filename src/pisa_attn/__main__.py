"""``python -m pisa_attn``: the ``pisa-attn`` command line."""

from .cli import main

raise SystemExit(main())
