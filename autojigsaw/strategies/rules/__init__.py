"""autojigsaw's own sharding rules, for the ops whose best layouts DTensor's rules miss.

Importing this package registers every rule; `strategies_for` looks one up by op.
"""

from . import (along_a_dim, attention, batch_norm, batched_matmul, conv, cross_entropy, einsum, elementwise,
               embedding, expert_gather, fft, group_norm, loss, matmul, moe, norm, pad, pool, random_draws, resample,
               routed_experts, softmax, unfold)
from .base import strategies_for

# Every file of this folder that registers rules, kernels or local costs (each does as it is imported,
# above); tests/test_registries.py fails on a file in neither tuple, or one here that registers nothing.
RULE_MODULES = (along_a_dim, attention, batch_norm, batched_matmul, conv, cross_entropy, einsum, elementwise,
                embedding, expert_gather, fft, group_norm, loss, matmul, moe, norm, pad, pool, random_draws,
                resample, routed_experts, softmax, unfold)
# the registry and what rules are written with; which rows a halo reads; what routed experts cost and send
HELPERS = ("base", "halo", "routed_experts_cost")

__all__ = ["HELPERS", "RULE_MODULES", "strategies_for"]
