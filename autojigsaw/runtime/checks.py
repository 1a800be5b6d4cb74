"""The checks a process group allows before a plan runs, and the device a mesh runs on."""

from __future__ import annotations

import functools
import hashlib
import os
from importlib.metadata import version
from pathlib import Path

import torch
import torch.distributed as dist

from ..capture import Captured
from ..capture.order import without_device_indices
from ..mesh import MeshSpec
from ..options import HEADROOM
from ..plan import Plan
from ..training import Regime
from .exchange import from_every_rank


def device_of(mesh) -> str:
    """The device spec name of a DeviceMesh's accelerators ("cpu" for a CPU mesh)."""
    kind = getattr(mesh, "device_type", "cpu")
    if kind == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name().lower()
        return next((d for d in ("h200", "h100", "a100") if d in name), "h100")
    return "cpu"


def default_budget(device_mesh) -> int:
    """Bytes per rank to plan under when none is given: all but HEADROOM of what the emptiest rank's
    device has free (a GPU's free memory; on CPU the host's memory shared by the ranks on this host)."""
    share = 1 - HEADROOM
    if getattr(device_mesh, "device_type", "cpu") == "cuda" and torch.cuda.is_available():
        mine = int(share * torch.cuda.mem_get_info()[0])
    else:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))
        mine = int(share * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(local_ranks, 1))
    if not dist.is_initialized():
        return mine
    return min(from_every_rank(mine, "the ranks' free memory"))  # one plan for all: it must fit the emptiest


def check_group(device_mesh, mesh: MeshSpec) -> None:
    """A process group must be up and the DeviceMesh must cover every rank of it."""
    if not dist.is_initialized():
        raise ValueError("parallelize needs a process group: call torch.distributed.init_process_group "
                         "(or run under torchrun) and pass a DeviceMesh; autojigsaw.plan needs none")
    if not hasattr(device_mesh, "get_group"):
        raise ValueError("parallelize needs a torch DeviceMesh (init_device_mesh(..., mesh_dim_names=...)); "
                         "a mapping of axis sizes only works with autojigsaw.plan")
    if mesh.world_size != dist.get_world_size():
        raise ValueError(f"the mesh {mesh.describe()} has {mesh.world_size} ranks but the process group "
                         f"has {dist.get_world_size()}: make the mesh cover every rank")


def check_plan(plan: Plan, mesh: MeshSpec, captured: Captured, regime: Regime) -> None:
    """The plan must be for this mesh, this regime and this model: its parameters, by name and shape."""
    if plan.mesh != mesh:
        raise ValueError(f"the plan was made for mesh {plan.mesh.describe()} but the module "
                         f"runs on {mesh.describe()}: plan again for this mesh")
    if plan.precision != regime.precision.describe():
        raise ValueError(f"the plan was made for precision '{plan.precision}' but parallelize is given "
                         f"'{regime.precision.describe()}': pass the mp_policy the plan was made with, or plan again")
    asked = regime.recompute
    if asked not in ("none", "auto") and {policy for _, policy in plan.recompute} != {asked}:
        raise ValueError(f"activation_checkpointing={asked!r} but the plan recomputes {plan.recompute_summary()}: "
                         f"a plan decides what is recomputed; plan again with activation_checkpointing={asked!r}, "
                         "or leave it out")
    ours = {captured.params[n.name]: tuple(n.meta["val"].shape) for n in captured.gm.graph.nodes
            if n.name in captured.params}
    planned = {n.module: n.shape for n in plan.nodes if n.kind == "param"}
    if ours != planned:
        differ = sorted(set(ours) ^ set(planned)) or sorted(f for f in ours if ours[f] != planned[f])
        seen = "; ".join(f"{fqn} is {planned.get(fqn, 'absent')} in the plan and {ours.get(fqn, 'absent')} "
                         "in the model" for fqn in differ[:3])
        raise ValueError(f"the plan was made for another model ({len(differ)} parameter(s) differ; {seen}): "
                         "plan again for this model, or pass plan=None")


def check_agreement(facts: dict[str, str]) -> None:
    """Every rank must run the same versions, model, input shapes, program and plan, or collectives would
    not match up: one exchange of small facts, before any collective of the step, and an error naming
    what differs and on which ranks (a rank whose planning failed says so in its "plan")."""
    mine = {"versions": installed_versions(), **facts}
    gathered = from_every_rank((mine, os.environ.get("PYTHONHASHSEED")), "the ranks' facts (model, inputs, plan)")
    for key in mine:
        by_value: dict[str, list[int]] = {}
        for rank, (theirs, _) in enumerate(gathered):
            by_value.setdefault(str(theirs.get(key)), []).append(rank)
        if len(by_value) > 1:
            seen = "; ".join(f"ranks {ranks}: {value[:300]}" for value, ranks in by_value.items())
            seeds = {seed for _, seed in gathered}
            hint = _HASH_SEED_HINT if key == "program" and (len(seeds) > 1 or seeds & {None, "random"}) else ""
            raise ValueError(f"ranks disagree on the {key} ({seen}): give every rank the same "
                             f"{_FIX.get(key, key)}, or plan once and pass plan={hint}")


def installed_versions() -> str:
    """The versions of torch and autojigsaw this rank runs, autojigsaw's by its source too (a plan cached by
    one build of the code is never served to another, nor do ranks run different code under one version)."""
    return f"torch {torch.__version__}, autojigsaw {_VERSION} (source {source_digest(PACKAGE)})"


@functools.cache
def source_digest(root: Path) -> str:
    """A digest of the Python sources under `root`: their paths and bytes."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


_FIX = {"versions": "installation (torch and autojigsaw versions, autojigsaw's source)",
        "model": "model (parameter names, shapes and dtypes)", "inputs": "input shapes and dtypes",
        "program": "model code (the program traced from it differs: a constant or an attribute set per rank, a "
                   "branch on the rank)",
        "plan": "model, inputs and options",
        "options": "options to parallelize (memory_budget, device, optimizer, mp_policy, ...)"}
_VERSION = version("autojigsaw")
PACKAGE = Path(__file__).resolve().parents[1]
_HASH_SEED_HINT = (". The ranks also hash strings with different seeds (PYTHONHASHSEED is not one value on every "
                   "rank), so a model that chooses by the order of a set of strings computes another program on "
                   "each rank (ops only traced in another order are put in rank 0's order instead). Launch every "
                   "rank with the same seed: PYTHONHASHSEED=0 torchrun ...")


def program_facts(captured: Captured) -> dict[str, str]:
    """What every rank must agree on before the step: the model's parameters, the input shapes and the
    traced program (a constant or a branch that differs by rank changes it; device indices do not)."""
    values = {n.name: n.meta.get("val") for n in captured.gm.graph.nodes if n.op == "placeholder"}
    model = hashlib.sha256(repr([(fqn, tuple(values[ph].shape), str(values[ph].dtype))
                                 for ph, fqn in sorted(captured.params.items(), key=lambda kv: kv[1])]).encode())
    inputs = [(tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else repr(v) for v in captured.input_values]
    program = hashlib.sha256(without_device_indices(captured.gm.code).encode())
    return {"model": model.hexdigest()[:16], "inputs": repr(inputs), "program": program.hexdigest()[:16]}
