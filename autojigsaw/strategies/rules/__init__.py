"""autojigsaw's own sharding rules, for the ops whose best layouts DTensor's rules miss.

Importing this package registers every rule; `strategies_for` looks one up by op.
"""

from . import along_a_dim, attention, batch_norm, batched_matmul, conv, cross_entropy, einsum, elementwise, fft, group_norm, loss, matmul, norm, pad, pool, random_draws, resample, softmax, unfold  # noqa: F401  (register the rules)
from . import moe  # noqa: F401  (mixture-of-experts grouped matmuls)
from .base import strategies_for

__all__ = ["strategies_for"]
