"""Plan: the sharding chosen for every node, as plain data that prints, saves and loads.

Deciding is separate from doing: the planner returns a Plan, the rewrite applies one.
A user can print a Plan, edit it, save it to JSON and apply it again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

from tabulate import tabulate

from .mesh import MeshSpec
from .modules import short_paths
from .pipeline import STAGE_FIELDS, Pipeline, StagePlan
from .placements import Placements, format_placements, parse_placements
from .plan_text import (format_bytes, format_seconds, span_name, stages_table, MODULE_WIDTH, kernel_cell, legend,
                        narrow_table, placements_cell, short_op, wrapped, collapsed, node_row, group_module,
                        group_name, group_costs)
from .training import splits_data

SHOWN_KINDS = ("matmul", "attention", "softmax", "norm", "embedding")


@dataclass(frozen=True)
class NodeSharding:
    """How one graph node runs: its input/output placements, kernel and predicted costs.

    `name` (the ATen node, "linear_3"), `op` ("aten.linear"), `kind` (matmul, attention,
    softmax, norm, embedding, param, input or other), `module` (its module path or a
    parameter's FQN), `shape` of its first output and `input_shapes`; `inputs` / `outputs`:
    one placements tuple per tensor, one DTensor placement per mesh axis (S(d): sharded on dim
    d, R: replicated, P(sum): partial sums); `kernel` that runs it ("local" or a distributed
    kernel); `fallback`: no rule shards it, it runs whole; `note`: why. Predicted per rank:
    `comm_bytes` (bytes sent per step), `comm_s` and `compute_s` (seconds), `memory_bytes`.

        for n in plan.nodes:  # autojigsaw.NodeSharding
            print(n.module, n.kernel, n.outputs, n.compute_s)
    """

    name: str
    op: str
    kind: str  # matmul | attention | softmax | norm | embedding | param | input | other
    shape: tuple[int, ...]  # of the first output
    inputs: tuple[Placements, ...]
    outputs: tuple[Placements | None, ...]
    kernel: str = "local"
    fallback: bool = False
    note: str = ""
    comm_bytes: int = 0  # sent per rank per step, resharding into this node included
    compute_s: float = 0.0  # forward (+ backward) on the largest shard, kernel-internal comm included
    memory_bytes: int = 0  # what this node holds: its output (or parameter, gradient, optimizer
    #                        state) and what it saves for backward, per rank
    comm_s: float = 0.0  # predicted time of the resharding into this node (and its gradient back)
    input_shapes: tuple[tuple[int, ...], ...] = ()
    module: str = ""  # the module it runs in ("model.layers.3.mlp.down_proj"), or a parameter's FQN

    @property
    def output(self) -> Placements | None:
        return self.outputs[0] if self.outputs else None


@dataclass(frozen=True)
class PlanStats:
    """How planning went: seconds per stage, problem size, memory rows the solver added."""

    strategies_s: float
    problem_s: float
    solve_s: float
    traffic_s: float
    nodes: int
    groups: int  # variables groups after tying repeated layers
    strategies: int  # binary variables
    solves: int
    memory_cuts: int
    gap: float = 0.0  # how far above the fastest plan it may be, relative to its step time: 0 = proven optimal
    from_cache: bool = False  # read from the plan cache (AUTOJIGSAW_CACHE), not solved in this process

    def __str__(self) -> str:
        source = "read from the plan cache; " if self.from_cache else ""
        return (f"{source}planned {self.nodes} nodes as {self.groups} groups ({self.strategies} binaries): "
                f"strategies {self.strategies_s:.2f} s, costs {self.problem_s:.2f} s, solve {self.solve_s:.2f} s "
                f"({self.solves} MILP(s), {self.memory_cuts} memory row(s)), traffic {self.traffic_s:.2f} s; "
                f"{self.proof()}")

    def proof(self) -> str:
        """What the solve proved: "optimal", or "within 0.4 % of optimal"."""
        return proof_text(self.gap)


def proof_text(gap: float) -> str:
    """"optimal" for a gap of 0, else "within 0.4 % of optimal"."""
    return "optimal" if gap <= 0 else f"within {100 * gap:.2g} % of optimal"


@dataclass(frozen=True)
class MeshChoice:
    """A mesh the planner weighed for a number of GPUs: its predicted step (seconds; None: not priced) and peak
    memory per rank (bytes), whether it was planned exactly or estimated, and a note."""

    mesh: MeshSpec
    step_time: float | None
    memory: float
    exact: bool
    note: str = ""


@dataclass(frozen=True)
class Plan:
    """A sharding for every node of one model on one mesh, with its predicted costs.

    `mesh` (MeshSpec), `device` (the spec's name), `training`; `nodes`: a NodeSharding per
    graph node; `param_placements` (parameter FQN -> placements), `input_placements`,
    `output_placements`: one DTensor placement per mesh axis each. Predicted per rank and step:
    `memory_per_rank` (peak bytes, at `peak_at`: on a device with torch's CUDA caching allocator the
    bytes it reserves, torch.cuda.max_memory_reserved, and `memory_allocated` those it hands out,
    max_memory_allocated; elsewhere the bytes live, and `memory_allocated` None), `comm_bytes` (bytes
    sent), `step_time` (seconds), under `memory_budget` (bytes). `precision`, `recompute` ((layer,
    "selective" | "selective-op" | "full") pairs) and `data_parallel` ("fsdp" | "ddp" | None) are the
    regime; `stats`: how planning went; `gap`: what its solve proved (0: optimal; kept in its JSON);
    `explainer`: the planner's data behind `explain`; `microbatches` per data replica and step (gradient
    accumulation, or the pipeline's), `sums_once`: the data axis sums the gradients outside the graph
    (FSDP's, each microbatch's; DDP's under accumulation, once per step); `alternatives`: given a number
    of GPUs for the mesh, the other meshes tried (autojigsaw.plan.MeshChoice); `pipeline`: with a pipe
    axis, the stages (autojigsaw.plan.Pipeline), each with its plan on the other axes; `moe_imbalance`:
    the routing that routed experts' times and bytes are predicted at (Options.moe_imbalance);
    `whole_inputs`: each rank is passed every input whole and holds it (False: its shards, as with
    Options.input_placements). print() gives the table.

        plan = autojigsaw.plan(model, (x,), {"domain": 2, "tensor": 2})  # an autojigsaw.Plan
        open("plan.json", "w").write(plan.to_json())
        pmodel = autojigsaw.parallelize(model, mesh, (x,), plan=autojigsaw.Plan.from_json(open("plan.json").read()))
    """

    mesh: MeshSpec
    device: str
    training: bool
    nodes: tuple[NodeSharding, ...]
    param_placements: dict[str, Placements] = field(hash=False)
    input_placements: tuple[Placements | None, ...]
    output_placements: tuple[Placements | None, ...]
    memory_per_rank: int  # predicted peak bytes per rank for one step
    comm_bytes: int  # predicted bytes each rank sends in one step
    step_time: float  # predicted seconds per step
    memory_budget: int | None = None
    peak_at: str = ""  # the program point of the peak ("backward of linear_3")
    precision: str = "model dtype"  # how parameters compute (Precision.describe)
    recompute: tuple[tuple[str, str], ...] = ()  # (layer, policy) for each recomputed layer
    data_parallel: str | None = None  # "fsdp" | "ddp" on the mesh's data axis
    memory_allocated: int | None = None  # caching allocator: predicted max_memory_allocated (memory_per_rank: reserved)
    stats: PlanStats | None = field(default=None, compare=False)
    explainer: Callable | None = field(default=None, compare=False, repr=False)
    microbatches: int = 1  # per data replica and step: gradient accumulation, or the pipeline's
    sums_once: bool = False  # the data axis sums the weights' gradients once per step, out of the graph
    alternatives: tuple[MeshChoice, ...] = field(default=(), compare=False)  # the meshes a chosen mesh beat
    pipeline: Pipeline | None = None  # the stages over a pipe axis, each with its plan on the other axes
    moe_imbalance: float = 1.0  # the routing routed experts are priced at: busiest rank's tokens / mean
    whole_inputs: bool = True  # each rank is passed every input whole and holds it (False: its shards)
    gap: float | None = field(default=None, compare=False)  # what its solve proved (0: optimal); None: not solved

    def __getstate__(self) -> dict:
        """Plain data only: the planner's explainer stays with the process that planned."""
        return {**self.__dict__, "explainer": None}

    def node(self, name: str) -> NodeSharding:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"the plan has no node {name!r}")

    def split_over_data(self, placeholders: Iterable[str]) -> frozenset[str]:
        """Those of the weights `placeholders` that this plan splits over a data axis (training.splits_data)."""
        wanted = set(placeholders)
        return frozenset(n.name for n in self.nodes if n.name in wanted and splits_data(n.output, self.mesh))

    @property
    def fallbacks(self) -> list[NodeSharding]:
        return [n for n in self.nodes if n.fallback]

    def fingerprint(self) -> str:
        """A short hash of the decisions (not the predictions): equal on ranks that agree."""
        decisions = [(n.name, [format_placements(p) for p in n.inputs],
                      [format_placements(p) if p else None for p in n.outputs], n.kernel)
                     for n in self.nodes]
        if self.microbatches != 1 or self.pipeline is not None:  # a plain plan's hash as it always was
            pipe = self.pipeline
            decisions.append((self.microbatches, None if pipe is None else
                              (pipe.schedule, pipe.virtual_stages, [(st.rank, st.layers) for st in pipe.stages])))
        return hashlib.sha256(json.dumps(decisions).encode()).hexdigest()[:16]

    # ------------------------------------------------------------ printing

    def table(self, *, every_node: bool = False, wide: bool = False) -> str:
        """The plan as a table a person reads: one row per kind of matmul / attention / softmax /
        norm / embedding / fallback node, repeated layers collapsed into one row (`every_node=True`:
        one row per graph node), rows for everything else, so that each column sums to TOTAL.
        Its lines fit 120 characters: module, op, placements, kernel, comm/rank and time columns;
        `wide=True`: every column (node, shapes, comm time, compute, memory, note), lines unwrapped."""
        if self.pipeline is not None:
            return self._pipeline_table(every_node=every_node, wide=wide)
        shown = [n for n in self.nodes if every_node or n.kind in SHOWN_KINDS or n.fallback]
        groups = collapsed(shown) if not every_node else [[n] for n in shown]
        hidden = [n for n in self.nodes if n not in set(shown)]
        if not wide:
            return self._narrow_table(groups, hidden)
        rows = [node_row(group) for group in groups]
        if hidden:
            rows.append(node_row(hidden, label=f"({len(hidden)} other nodes: views, elementwise, parameters)"))
        unattributed = self.comm_bytes - sum(n.comm_bytes for n in self.nodes)
        if unattributed:
            what = "FSDP: gathers and gradient reduce-scatters on the data axis" if self.data_parallel == "fsdp" else "other"
            rows.append(("", f"({what})", "", "", "", "", "", format_bytes(unattributed), "", "", "", ""))
        headers = ["module", "node", "op", "shapes", "inputs", "output", "kernel", "comm/rank", "comm time",
                   "compute", "memory", "note"]
        comm_s = sum(n.comm_s for n in self.nodes)
        rows.append(("TOTAL", "", "", "", "", "", f"{len(self.fallbacks)} fallback(s)", format_bytes(self.comm_bytes),
                     format_seconds(comm_s), format_seconds(self.step_time - comm_s), "peak " + format_bytes(self.memory_per_rank),
                     f"step {format_seconds(self.step_time)}"))
        legend = (f"placements: one per mesh axis ({', '.join(self.mesh.axis_names)}); S(d) = split along tensor dim d, "
                  "R = whole copy, P(sum) = partial sums still to add; inputs: activation, weight, bias; "
                  "kernel: local = the op on local shards, others = autojigsaw's distributed kernels; "
                  "fallback = no sharding rule, run replicated")
        return tabulate(rows, headers=headers, tablefmt="simple") + "\n" + self._summary() + "\n" + legend

    def _narrow_table(self, groups: list[list[NodeSharding]], hidden: list[NodeSharding]) -> str:
        """The default table (plan_text): lines of at most 120 characters, module paths cut in the middle."""
        modules = [group_module(group) or group_name(group) for group in groups]
        short = short_paths(modules, MODULE_WIDTH)
        rows = [(short[m], short_op(g[0].op), placements_cell(g[0].inputs, g[0].output),
                 kernel_cell(g[0].kernel, g[0].fallback), *group_costs(g)) for m, g in zip(modules, groups)]
        if hidden:
            rows.append((f"({len(hidden)} other nodes)", "", "views, elementwise, parameters", "", *group_costs(hidden)))
        unattributed = self.comm_bytes - sum(n.comm_bytes for n in self.nodes)
        extra = self.step_time - sum(n.comm_s + n.compute_s for n in self.nodes)  # FSDP's traffic, as exposed
        extra = 0.0 if abs(extra) <= 1e-9 * self.step_time else extra
        if unattributed or extra:
            what = "gathers, reduce-scatters on data" if self.data_parallel == "fsdp" else ""
            rows.append(("(FSDP)" if what else "(other)", "", what, "", format_bytes(unattributed),
                         ("-" if extra < 0 else "") + format_seconds(abs(extra)) if extra else ""))
        rows.append(("TOTAL", "", "", f"{len(self.fallbacks)} fallback(s)", format_bytes(self.comm_bytes),
                     format_seconds(self.step_time)))
        footer = self._summary() + "\n" + legend(self.mesh.axis_names, fsdp=self.data_parallel == "fsdp")
        return narrow_table(rows) + "\n" + wrapped(footer)

    def _pipeline_table(self, *, every_node: bool, wide: bool) -> str:
        """A pipelined plan: its schedule and a row per stage, then each kind of stage's own table (the first,
        the middle ones alike, the last), each per microbatch, then the step's summary."""
        pipe = self.pipeline
        parts = [wrapped(f"pipeline over {pipe.axis}={pipe.ranks}: {pipe.schedule}, {pipe.microbatches} microbatch(es) "
                         f"per data replica and step, {pipe.virtual_stages} stage(s) per rank; bubble "
                         f"{pipe.bubble:.1%}" + (f"; FSDP gathers {pipe.fsdp_gathers}" if pipe.fsdp_gathers else "")),
                 stages_table(pipe.stages)]
        shown = {}
        for st in pipe.stages:
            shown.setdefault((len(st.layers), st.index == 0, st.index == len(pipe.stages) - 1), st)
        for st in shown.values():
            parts.append(f"\nstage {st.index} ({span_name(st.layers)}) on {pipe.axis} rank {st.rank}, per microbatch:")
            parts.append(st.plan.table(every_node=every_node, wide=wide))
        return "\n".join(parts) + "\n\n" + wrapped(self._summary())

    def _summary(self) -> str:
        """The lines under the table: mesh, regime, predicted step, traffic and peak; layout; precision."""
        budget = f" of {format_bytes(self.memory_budget)} budget" if self.memory_budget else ""
        return (
            f"mesh {self.mesh.describe()} on {self.device}, "
            f"{'training' if self.training else 'inference'}: "
            f"predicted step {format_seconds(self.step_time)}, comm {format_bytes(self.comm_bytes)}/rank, "
            f"peak memory {format_bytes(self.memory_per_rank)}/rank{self._allocated()}{budget}"
            + (f" at the {self.peak_at}" if self.peak_at else "") + f"; {len(self.fallbacks)} fallback node(s)"
            + f"\nlayout: {self.layout()}\nprecision: {self.precision}; recompute: {self.recompute_summary()}"
            + (f"; data axis: {self.data_parallel}" if self.data_parallel else "")
            + (f"; plan {proof_text(self.gap)}" if self.gap is not None else "")
        )

    def _allocated(self) -> str:
        if self.memory_allocated is None:
            return ""
        return f" reserved ({format_bytes(self.memory_allocated)} allocated)"

    def layout(self) -> str:
        """The chosen layout per mesh axis, in words ("tensor: 12/14 weights split, activations split")."""
        if self.pipeline is not None:
            pipe = self.pipeline
            return (f"{pipe.axis}: {len(pipe.stages)} stages on {pipe.ranks} ranks; "
                    + pipe.stages[0].plan.layout().replace("replicated:", "stages replicated:"))
        parts, anything = [], False
        weights = [n for n in self.nodes if n.kind == "param" and n.output]
        for a, axis in enumerate(self.mesh.axis_names):
            split = sum(not n.output[a].is_replicate() for n in weights)
            acts = any(n.output and n.output[a].is_shard() for n in self.nodes if n.kind not in ("param", "input"))
            anything = anything or split > 0 or acts
            parts.append(f"{axis}: {split}/{len(weights)} weights split" + (", activations split" if acts else ""))
        if not anything:
            return "replicated: it fits the budget and sharding would be slower (give a smaller memory_budget to force it)"
        return "; ".join(parts)

    def summary_line(self) -> str:
        """One line: mesh, layout, predicted step time, memory and bytes, and what the solve proved (what
        parallelize logs): "...; plan optimal" or "...; plan within 0.4 % of optimal"."""
        proof = "" if self.gap is None else f"; plan {proof_text(self.gap)}" + (
            " (from the plan cache)" if self.stats is not None and self.stats.from_cache else "")
        return (f"autojigsaw: {self.mesh.describe()} on {self.device}: {self.layout()}; predicted step "
                f"{format_seconds(self.step_time)}, peak {format_bytes(self.memory_per_rank)}/rank{self._allocated()}, "
                f"{format_bytes(self.comm_bytes)} sent/rank/step; {len(self.fallbacks)} fallback node(s)" + proof)

    def recompute_summary(self) -> str:
        """"selective on model.layers.{0..31}" (x32), or "none"."""
        if not self.recompute:
            return "none"
        by_policy: dict[str, list[str]] = {}
        for layer, policy in self.recompute:
            by_policy.setdefault(policy, []).append(layer)
        parts = []
        for policy, layers in by_policy.items():
            prefix = layers[0].rsplit(".", 1)[0]
            idx = [int(name.rsplit(".", 1)[1]) for name in layers]
            parts.append(f"{policy} on {prefix}.{{{min(idx)}..{max(idx)}}} (x{len(layers)})")
        return ", ".join(parts)

    def explain(self, node: str) -> str:
        """Every candidate strategy of `node` with its costs, why the chosen one won, and its formulas."""
        self.node(node)
        if self.explainer is None:
            raise ValueError("this plan carries no planner data (it was loaded or edited): explain needs "
                             "the plan that autojigsaw.plan or parallelize made")
        return str(self.explainer(node))

    def alternatives_table(self) -> str:
        """The meshes this plan's mesh beat (given a number of GPUs), fastest first: step, memory, how priced."""
        rows = [(self.mesh.describe(), format_seconds(self.step_time), format_bytes(self.memory_per_rank), "chosen")]
        rows += [(c.mesh.describe(), "-" if c.step_time is None else format_seconds(c.step_time),
                  format_bytes(c.memory), c.note) for c in self.alternatives]
        return tabulate(rows, headers=("mesh", "step", "memory/rank", ""), tablefmt="simple", disable_numparse=True)

    def __str__(self) -> str:
        if self.alternatives:
            return self.table() + "\n\n" + self.alternatives_table()
        return self.table()

    # ------------------------------------------------------------ JSON

    def to_json(self) -> str:
        return json.dumps(self.as_data(), indent=1)

    def as_data(self) -> dict:
        """The plan as plain JSON data (placements as text): what to_json writes."""
        def pl(p):
            return None if p is None else format_placements(p)

        data = {
            "mesh": {"axis_names": list(self.mesh.axis_names), "sizes": list(self.mesh.sizes)},
            "device": self.device, "training": self.training,
            "param_placements": {k: pl(v) for k, v in self.param_placements.items()},
            "input_placements": [pl(p) for p in self.input_placements],
            "output_placements": [pl(p) for p in self.output_placements],
            "memory_per_rank": self.memory_per_rank, "comm_bytes": self.comm_bytes,
            "step_time": self.step_time, "memory_budget": self.memory_budget, "peak_at": self.peak_at,
            "precision": self.precision, "recompute": [list(r) for r in self.recompute],
            "data_parallel": self.data_parallel,
            **({"memory_allocated": self.memory_allocated} if self.memory_allocated is not None else {}),
            "nodes": [{**asdict(n), "inputs": [pl(p) for p in n.inputs],
                       "outputs": [pl(p) for p in n.outputs]} for n in self.nodes],
        }
        if self.microbatches != 1:
            data["microbatches"] = self.microbatches
        if self.sums_once:
            data["sums_once"] = True
        if self.moe_imbalance != 1.0:
            data["moe_imbalance"] = self.moe_imbalance
        if not self.whole_inputs:
            data["whole_inputs"] = False
        if self.gap is not None:
            data["gap"] = self.gap
        if self.pipeline is not None:
            pipe = self.pipeline
            data["pipeline"] = {**{k: getattr(pipe, k) for k in ("axis", "schedule", "microbatches", "virtual_stages",
                                                                 "bubble", "fsdp_gathers")},
                                "stages": [{**{k: getattr(st, k) for k in STAGE_FIELDS}, "plan": st.plan.as_data()}
                                           for st in pipe.stages]}
        return data

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_data(json.loads(text))

    @classmethod
    def from_data(cls, d: dict) -> Plan:
        """The plan `as_data` gave."""
        def pl(s):
            return None if s is None else parse_placements(s)

        nodes = tuple(
            NodeSharding(**{**n, "shape": tuple(n["shape"]),
                            "input_shapes": tuple(tuple(x) for x in n.get("input_shapes", ())),
                            "inputs": tuple(pl(p) for p in n["inputs"]),
                            "outputs": tuple(pl(p) for p in n["outputs"])})
            for n in d["nodes"]
        )
        pipe = d.get("pipeline")
        pipeline = None if pipe is None else Pipeline(
            **{k: v for k, v in pipe.items() if k != "stages"},
            stages=tuple(StagePlan(**{**{k: st[k] for k in STAGE_FIELDS}, "layers": tuple(st["layers"])},
                                   plan=cls.from_data(st["plan"])) for st in pipe["stages"]))
        return cls(
            mesh=MeshSpec(tuple(d["mesh"]["axis_names"]), tuple(d["mesh"]["sizes"])),
            device=d["device"], training=d["training"], nodes=nodes,
            param_placements={k: pl(v) for k, v in d["param_placements"].items()},
            input_placements=tuple(pl(p) for p in d["input_placements"]),
            output_placements=tuple(pl(p) for p in d["output_placements"]),
            memory_per_rank=d["memory_per_rank"], comm_bytes=d["comm_bytes"],
            step_time=d["step_time"], memory_budget=d["memory_budget"], peak_at=d.get("peak_at", ""),
            precision=d.get("precision", "model dtype"), recompute=tuple(tuple(r) for r in d.get("recompute", ())),
            data_parallel=d.get("data_parallel"), microbatches=d.get("microbatches", 1),
            sums_once=d.get("sums_once", False), pipeline=pipeline, moe_imbalance=d.get("moe_imbalance", 1.0),
            whole_inputs=d.get("whole_inputs", True), gap=d.get("gap"),
            memory_allocated=d.get("memory_allocated"),
        )

