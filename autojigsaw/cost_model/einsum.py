"""An einsum's letters ("..." spelled out) and its FLOPs: what its rule, its cost and Plan.explain read."""

from __future__ import annotations

import math
import string
from collections.abc import Sequence


def spelled_letters(equation: str, ndims: Sequence[int]) -> tuple[list[str], str] | None:
    """(each operand's letters, the output's), "..." spelled out; None for an implicit output."""
    equation = equation.replace(" ", "")
    if "->" not in equation:
        return None
    lhs, out = equation.split("->")
    terms = lhs.split(",")
    spare = [c for c in string.ascii_letters if c not in equation]
    widths = [n - (len(term) - 3) for term, n in zip(terms, ndims) if "..." in term]
    dots = spare[:max(widths, default=0)]

    def spell(term: str, ndim: int) -> str:
        if "..." not in term:
            return term
        k = ndim - (len(term) - 3)
        return term.replace("...", "".join(dots[len(dots) - k:]))

    return [spell(term, n) for term, n in zip(terms, ndims)], spell(out, len(dots) + len(out) - 3)


def einsum_flops(terms: Sequence[str], out: str, shapes: Sequence[Sequence]):
    """2 FLOPs per point of the letters' joint range, from the operands' and the output's (local)
    shapes: ints, or sympy expressions for Plan.explain (a letter takes its first extent that is not a broadcast 1)."""
    extent: dict = {}
    for term, shape in zip([*terms, out], shapes):
        for c, n in zip(term, shape):
            if extent.get(c, 1) == 1:
                extent[c] = n
    return 2 * math.prod(extent.values())
