"""Why a node runs the way the plan says: every candidate's costs next to the chosen one's.

The solver trades a node's compute against the resharding to and from its neighbours and
against memory. `explain` holds the neighbours at their chosen strategies and prices every
candidate of the node (of its whole group, when repeated layers share one choice): compute,
communication in and out, the step's peak memory. The chosen candidate is the fastest of
those that fit, unless the budget pushed it elsewhere; the formulas show where its time goes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import sympy
from tabulate import tabulate
from torch.fx import Node

from ..cost_model.estimate import CostContext, collective_steps, consumer_partial_axes
from ..cost_model.formulas import scaling
from ..cost_model.symbolic import Sizes, collective_formula, local_dims, node_formula
from ..ir import output_values, redistribute_steps, tensor_inputs
from ..placements import format_placements
from ..plan import format_seconds
from .milp import Solution
from .problem import Problem


@dataclass(frozen=True)
class Candidate:
    """One strategy of a node with its costs, the rest of the plan held fixed."""

    inputs: str
    outputs: str
    kernel: str
    compute_s: float
    comm_s: float
    peak_bytes: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s


@dataclass(frozen=True)
class Explanation:
    """Every candidate of one node, the chosen one, and the formulas of its costs."""

    node: str
    op: str
    chosen: int
    tied: int  # nodes deciding together (repeated layers)
    candidates: tuple[Candidate, ...]
    budget: float | None
    formulas: tuple[tuple[str, str], ...]  # (what, formula and value)

    def verdict(self) -> str:
        best = min(range(len(self.candidates)), key=lambda i: self.candidates[i].total_s)
        chosen = self.candidates[self.chosen]
        if chosen.total_s <= self.candidates[best].total_s * (1 + 1e-9):
            return "chosen: the fastest candidate given its neighbours' placements"
        faster = [c for c in self.candidates if c.total_s < chosen.total_s]
        over = [c for c in faster if self.budget is not None and c.peak_bytes > self.budget]
        if over and len(over) == len(faster):
            return (f"chosen: {len(faster)} faster candidate(s) would raise the peak memory over the "
                    f"budget of {_mib(self.budget)}")
        return ("chosen: faster here, a candidate would cost more elsewhere (its neighbours would "
                "choose differently, or the budget binds at another node of the plan)")

    def __str__(self) -> str:
        rows = [("*" if i == self.chosen else "", c.inputs, c.outputs, c.kernel, format_seconds(c.compute_s), format_seconds(c.comm_s),
                 format_seconds(c.total_s), _mib(c.peak_bytes) + (" > budget" if self.budget and c.peak_bytes > self.budget
                                                        else ""))
                for i, c in enumerate(self.candidates)]
        head = f"{self.node} ({self.op})"
        if self.tied > 1:
            head += f": one choice for {self.tied} nodes of repeated layers, costs summed over them"
        table = tabulate(rows, headers=["", "inputs", "outputs", "kernel", "compute", "comm", "total",
                                        "peak memory"], tablefmt="simple")
        lines = [head, table, self.verdict(), ""] + [f"{what}: {text}" for what, text in self.formulas]
        return "\n".join(lines)


class Explainer:
    """Builds Explanations on demand from the planner's own data (not part of the Plan's JSON)."""

    def __init__(self, nodes: list[Node], problem: Problem, solution: Solution, ctx: CostContext,
                 sizes: Sizes, budget: float | None, grad: dict[str, bool]):
        self.nodes, self.problem, self.solution, self.ctx = nodes, problem, solution, ctx
        self.sizes, self.budget, self.grad = sizes, budget, grad
        self.index = {n: i for i, n in enumerate(problem.names)}

    def __call__(self, name: str) -> Explanation:
        if name not in self.index:
            raise KeyError(f"the plan has no node {name!r}")
        p, choice = self.problem, self.solution.choice
        n = self.index[name]
        members = np.flatnonzero(p.group == p.group[n])
        in_group = set(members.tolist())
        edges = [e for e in p.edges if e.src in in_group or e.dst in in_group]
        candidates = []
        for t, s in enumerate(p.strategies[n]):
            trial = choice.copy()
            trial[members] = t
            compute = sum(p.time[m][t] for m in members)
            comm = sum(e.costs.time[trial[e.src], trial[e.dst]] for e in edges)
            candidates.append(Candidate(
                " ".join(format_placements(x) for x in s.inputs),
                " ".join(format_placements(x) if x is not None else "-" for x in s.outputs),
                s.kernel, float(compute), float(comm), p.memory.peak(trial)[0]))
        node = self.nodes[n]
        return Explanation(name, str(node.target) if node.op == "call_function" else node.op, int(choice[n]),
                           len(members), tuple(candidates), self.budget, self._formulas(n))

    def _formulas(self, n: int) -> tuple[tuple[str, str], ...]:
        node, choice = self.nodes[n], self.solution.choice
        strategy = self.problem.strategies[n][choice[n]]
        out = [("sizes", self.sizes.legend())]
        names = self.sizes.symbol_names
        backward = self.ctx.training and self.grad.get(node.name, False)
        if node.op == "call_function" and strategy.kernel == "local":
            f = node_formula(node, strategy, self.sizes, self.ctx.device, backward)
            value = float(self.problem.time[n][choice[n]])
            factor = f" x {1 + f.backward:g} (forward + backward)" if f.backward else ""
            out += [(f"{f.kind} FLOPs", f"{f.flops}  (scales as {scaling(f.flops, names)})"),
                    ("bytes moved", f"{f.bytes}"),
                    ("time", f"{_short(f.time)}{factor} = {format_seconds(value)}")]
        elif strategy.kernel != "local":
            out.append(("time", f"kernel {strategy.kernel!r} prices itself (its registry.Kernel.cost): "
                                f"{format_seconds(float(self.problem.time[n][choice[n]]))}"))
        for k, (src, o) in enumerate(tensor_inputs(node)):
            out += self._edge(self.index[src.name], o, n, k)
        return tuple(out)

    def _edge(self, src: int, o: int, dst: int, k: int) -> list[tuple[str, str]]:
        choice, p = self.solution.choice, self.problem
        s_out = p.strategies[src][choice[src]].outputs[o]
        s_dst = p.strategies[dst][choice[dst]]
        val = output_values(self.nodes[src])[o]
        backward = self.ctx.training and self.grad.get(self.nodes[src].name, False)
        partial = consumer_partial_axes(s_dst, k)
        steps = collective_steps(tuple(val.shape), val.dtype.itemsize, s_out, s_dst.inputs[k], partial,
                                 backward, self.ctx.mesh)
        if not steps:
            return []
        shown = []
        before = {st.axis: st.before for st in redistribute_steps(s_out, s_dst.inputs[k])}
        for kind, nbytes, axis in steps:
            dims = local_dims(val.shape, before.get(axis, s_out), self.sizes)
            sym_bytes = math.prod(dims) * val.dtype.itemsize
            t = collective_formula(kind, sym_bytes, axis, self.sizes, self.ctx.device)
            shown.append((f"input {k} from {self.nodes[src].name}",
                          f"{kind} over {self.ctx.mesh.axis_names[axis]!r} of {nbytes} B "
                          f"(~{sympy.simplify(sym_bytes)}): time {_short(t)}"))
        return shown


def _short(expr: sympy.Expr) -> str:
    return str(sympy.N(expr, 3))


def _mib(b: float | None) -> str:
    return f"{(b or 0) / 2**20:.2f} MiB"
