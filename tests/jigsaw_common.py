"""Helpers of the domain-parallel tests: plans pinned to chosen strategies, and a worker that
trains a parallelized model beside its single-device twin.

Plans are made once in the test process (planning needs no process group) and sent to the
ranks as JSON; the ranks only capture, rewrite and run.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import autojigsaw
from autojigsaw.capture import capture
from autojigsaw.cost_model.devices import LinkSpec, device_spec
from autojigsaw.ir import STRATEGIES
from autojigsaw.kernels.collectives import count_comm
from autojigsaw.mesh import MeshSpec
from autojigsaw.placements import format_placements
from autojigsaw.rewrite.traffic import traffic_by_origin
from autojigsaw.runtime.materialize import local_view
from autojigsaw.strategies.annotate import annotate
from autojigsaw.testing.local_ranks import get_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from mixer_model import FieldLoss, MixerBlock, WeatherMixer  # noqa: E402
import jigsaw_weathermixer  # noqa: E402,F401  (the Jigsaw paper's WeatherMixer)

__all__ = ["BANDWIDTH_BOUND", "FieldLoss", "MixerBlock", "WeatherMixer", "assert_matches", "inputs_are",
           "outputs_are", "pinned_plan", "rows_plan", "seeded", "train_side_by_side"]

# Links whose time is bytes / bandwidth, no latency: tiny test tensors are then planned as if
# they were the large ones (the "cpu" spec's 100 us per message would hide every byte count).
_LINK = LinkSpec("bandwidth only", 0.0, 1e7)
BANDWIDTH_BOUND = device_spec("cpu").with_links(_LINK, _LINK)

TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


def seeded(cls, dtype: torch.dtype, **kwargs) -> torch.nn.Module:
    """cls(**kwargs) initialized from seed 0, in dtype: the same model on every rank."""
    torch.manual_seed(0)
    return cls(**kwargs).to(dtype)


def inputs_are(*texts: str):
    """A pin: the strategy whose input placements read `texts` ("S(1),R", ...), in order."""
    return lambda s: tuple(format_placements(p) for p in s.inputs) == texts


def outputs_are(*texts: str):
    """A pin on output placements (a parameter or input has no inputs, one output)."""
    return lambda s: tuple(format_placements(p) for p in s.outputs if p is not None) == texts


def pinned_plan(model, inputs, mesh: dict, pins: dict | None = None, **options) -> autojigsaw.Plan:
    """autojigsaw.plan (on the "cpu" device unless `device=`), node `name` restricted to the
    strategies `pins[name]` accepts (constraints=)."""
    options.setdefault("device", "cpu")
    return autojigsaw.plan(model, inputs, mesh, constraints=pins or None, **options)


def rows_plan(model, inputs, mesh: dict, layout: str = "S(2)") -> autojigsaw.Plan:
    """pinned_plan with every convolution that offers `layout` for its input ("S(2)": an image's rows)
    taking it (a 1x1 one on a 1x1 map, or a 2-row output over 4 ranks, offers none)."""
    gm = capture(model, inputs).gm
    annotate(gm, MeshSpec.of(mesh))
    rows = [n.name for n in gm.graph.nodes if n.name.startswith("conv")
            and any(format_placements(s.inputs[0]) == layout for s in n.meta[STRATEGIES])]
    return pinned_plan(model, inputs, mesh, dict.fromkeys(rows, lambda s: format_placements(s.inputs[0]) == layout))


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def _ramp(y: torch.Tensor) -> torch.Tensor:
    """Loss weights: no normalization makes the loss constant (a plain sum of squares after an
    RMSNorm would be)."""
    return torch.linspace(0.5, 1.5, y.numel(), dtype=y.dtype).view_as(y)


def train_side_by_side(make, inputs, mesh_shape, plan_json: str) -> dict:
    """Two steps of `make()` parallelized by a plan (as JSON) and on one device, the generator
    seeded alike before each forward: largest differences, bytes.

    The loss is a weighted sum of squares of the output (of this rank's shard of it, if the plan
    returns a sharded output). Step 1 also differentiates the inputs; step 2 counts the bytes sent
    (the inputs' gradients aside: the module's slicing of whole inputs sends them outside the
    graph) and compares them with the graph's prediction.
    """
    plan = autojigsaw.Plan.from_json(plan_json)
    ref = make()
    model = copy.deepcopy(ref)
    mesh = get_mesh(mesh_shape, plan.mesh.axis_names)
    pmodel = autojigsaw.parallelize(model, mesh, inputs, plan=plan, compile=False)
    coord = pmodel.program.rank.coord
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (pmodel, ref))
    diffs = dict.fromkeys(("output", "grad", "input_grad", "param"), 0.0)
    for step in range(2):
        mine = [x.clone().requires_grad_(step == 0 and x.is_floating_point()) for x in inputs]
        theirs = [x.clone().requires_grad_(step == 0 and x.is_floating_point()) for x in inputs]
        torch.manual_seed(step)  # random draws (dropout) see the same generator on both sides
        y_ref = ref(*theirs)
        (y_ref.square() * _ramp(y_ref)).sum().backward()
        with count_comm() as log:
            torch.manual_seed(step)
            y = pmodel(*mine)
            shard = local_view(y_ref.detach(), plan.output_placements[0], mesh_shape, coord)
            weights = local_view(_ramp(y_ref), plan.output_placements[0], mesh_shape, coord)
            (y.square() * weights).sum().backward()
        diffs["output"] = max(diffs["output"], _diff(y, shard))
        for a, b in zip(mine, theirs):
            if b.grad is not None:
                diffs["input_grad"] = max(diffs["input_grad"], _diff(a.grad, b.grad))
        for p, q in zip(pmodel.parameters(), ref.parameters()):
            diffs["grad"] = max(diffs["grad"], _diff(p.grad.full_tensor(), q.grad))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for p, q in zip(pmodel.parameters(), ref.parameters()):
        diffs["param"] = max(diffs["param"], _diff(p.full_tensor(), q))
    params = set(pmodel.program.captured.params)
    predicted = sum(traffic_by_origin(pmodel.program.graph, pmodel.program.rank, params, True).values())
    kernels = sorted({getattr(n.target, "__name__", "") for n in pmodel.program.graph.graph.nodes
                      if n.op == "call_function"})
    return {**diffs, "sent": log.total_bytes, "predicted": predicted, "kernels": kernels,
            "rank": dist.get_rank()}


def assert_matches(results: list[dict], dtype: torch.dtype) -> None:
    """Every rank: equal to one device within the dtype's tolerance, and sent what was predicted."""
    for r in results:
        for key in ("output", "grad", "input_grad", "param"):
            assert r[key] <= TOL[dtype], (r["rank"], key, r[key])
        assert r["sent"] == r["predicted"], (r["rank"], r["sent"], r["predicted"])
