"""Cost formulas: sympy expressions, compiled once to numpy functions.

Every cost the planner uses is a `Formula`: a sympy expression in a few named quantities
(FLOPs in the local dims M, N, K; collective time in bytes, ranks, latency, bandwidth). The
planner evaluates the compiled function on numpy arrays (all strategies of a node at once);
`Plan.explain` prints the same expression with the model's sizes and the mesh axes put in,
so the printed formula is the one that was evaluated.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import sympy


def _maximum(*args):
    return functools.reduce(np.maximum, args)


def _minimum(*args):
    return functools.reduce(np.minimum, args)


_MODULES = [{"Max": _maximum, "Min": _minimum, "ceiling": np.ceil}, "numpy"]


@dataclass(frozen=True)
class Formula:
    """A named sympy expression of `args`, with a numpy function compiled on first use."""

    name: str
    expr: sympy.Expr
    args: tuple[sympy.Symbol, ...]
    _compiled: list = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self):
        unknown = self.expr.free_symbols - set(self.args)
        if unknown:
            raise ValueError(f"formula {self.name!r} uses {sorted(map(str, unknown))} but takes only "
                             f"{[str(a) for a in self.args]}")

    def __call__(self, *values):
        """Evaluate on numbers or numpy arrays (broadcast), without sympy."""
        if not self._compiled:
            self._compiled.append(sympy.lambdify(self.args, self.expr, modules=_MODULES))
        return self._compiled[0](*values)

    def subs(self, values: dict) -> sympy.Expr:
        """The expression with some arguments replaced (numbers or other expressions)."""
        return self.expr.subs({a: values[str(a)] for a in self.args if str(a) in values})

    def __str__(self) -> str:
        return f"{self.name}({', '.join(map(str, self.args))}) = {self.expr}"


def symbols(names: str) -> tuple[sympy.Symbol, ...]:
    """Positive sympy symbols (sizes, rates and times are never negative)."""
    return sympy.symbols(names, positive=True)


def scaling(expr: sympy.Expr, names: set[str]) -> str:
    """How `expr` grows with the named symbols: "batch*seq/(domain*tensor)" (constants dropped)."""
    expr = sympy.sympify(expr)
    if isinstance(expr, (sympy.Max, sympy.Min)):
        return " | ".join(scaling(a, names) for a in expr.args)
    terms = sympy.Add.make_args(sympy.expand(expr))
    kept = set()
    for term in terms:
        powers = {s: e for s, e in term.as_powers_dict().items()
                  if isinstance(s, sympy.Symbol) and str(s) in names}
        kept.add(sympy.Mul(*(s**e for s, e in powers.items())))
    shown = sorted(kept, key=sympy.default_sort_key)
    return " + ".join(str(k) for k in shown) if shown else "constant"
