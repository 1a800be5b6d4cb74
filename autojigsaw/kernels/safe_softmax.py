"""_safe_softmax over a sharded dim: softmax, but 0 (and a 0 gradient) on rows that are all -inf.

Every -inf entry is raised to the dtype's lowest finite value before the sharded softmax and
its result set to 0 after: a row with a finite entry gives the same values as before (exp
underflows to 0 there), a row of -inf only becomes uniform instead of NaN and is then zeroed,
so no NaN reaches the gradient -- which a test for all -inf rows across ranks would need a
second all-reduce for.
"""

from __future__ import annotations

import torch

from ..mesh import MeshAxis
from .softmax import sharded_softmax


def sharded_safe_softmax(x, dim: int, *, half_to_float: bool = False, axis: MeshAxis):
    """aten._safe_softmax over `dim`, whose chunks are spread over `axis`: this rank's chunk."""
    hidden = x == float("-inf")
    lowest = torch.finfo(x.dtype).min
    y = sharded_softmax(x.masked_fill(hidden, lowest), dim, half_to_float=half_to_float, axis=axis)
    return y.masked_fill(hidden, 0.0)
