"""PISA under sequence/context parallelism on ``torch.distributed`` process groups.

* :func:`ulysses_pisa_attention`: all-to-all heads <-> sequence, PISA per head on the whole sequence.
* :func:`ring_pisa_attention`: keys stay sharded; global statistics and selection, ring steps on
  the chosen backend's kernels, merged through the log-sum-exp (:func:`pisa_attn.ops.merge.merge`).
* :func:`unified_pisa_attention`: Ulysses inside groups of ranks, ring across the groups.

All equal single-process :func:`pisa_attn.pisa_attention` on the global sequence (same selection,
float tolerance). Inference only.
"""

from .ring import ring_pisa_attention
from .ulysses import ulysses_attention, ulysses_pisa_attention
from .unified import unified_pisa_attention

__all__ = ["ring_pisa_attention", "ulysses_pisa_attention", "ulysses_attention", "unified_pisa_attention"]
