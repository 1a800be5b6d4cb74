"""A plan's memory over the step, by kind: parameters, gradients, optimizer state, activations, buffers.

The items of a MemoryModel (liveness.py) carry no kind; step_memory.py writes them in an order this reads
back. A parameter's (or buffer's) items: the weight resident all step (its first item spanning the step),
copies gathered while its FSDP unit runs (parameters), its optimizer states (its second item spanning the
step), then its gradient's items (gradients). Every other node's items are activations (what the forward keeps
for the backward, and the backward's own values); the optimizer step's temporaries are optimizer state;
resharding buffers are communication. The kinds partition the items: they sum to MemoryModel.profile.
"""

from __future__ import annotations

import numpy as np

from .liveness import MemoryModel

KINDS = ("parameters", "gradients", "optimizer state", "activations", "communication buffers")


def profile_by_kind(memory: MemoryModel, choice: np.ndarray, persistent: set[str]) -> dict[str, np.ndarray]:
    """Bytes live at every program point per kind, for one strategy index per node; `persistent`: the names of
    the parameter and buffer nodes."""
    end = memory.n_points - 1
    diff = {kind: np.zeros(memory.n_points + 1) for kind in KINDS}
    whole_step: dict[int, int] = {}  # node -> its items spanning the whole step, so far

    def add(kind: str, start: int, stop: int, nbytes: float) -> None:
        diff[kind][start] += nbytes
        diff[kind][stop + 1] -= nbytes

    for item in memory.lin:
        nbytes = float(memory.vectors[item.vec][choice[item.node]] * item.scale)
        add(_linear_kind(item, memory.names[item.node] in persistent, end, whole_step), item.start, item.end, nbytes)
    for item in memory.maxes:
        nbytes = max(float(memory.vectors[m.vec][choice[m.node]] * m.scale) for m in item.members)
        optimizer = item.start == item.end == end and all(memory.names[m.node] in persistent for m in item.members)
        add("optimizer state" if optimizer and memory.training else "activations", item.start, item.end, nbytes)
    for item in memory.pairs:
        add("communication buffers", item.start, item.end, memory.pair_bytes(item, choice[item.src], choice[item.dst]))
    return {kind: np.cumsum(d)[:-1] for kind, d in diff.items()}


def _linear_kind(item, persistent: bool, end: int, whole_step: dict[int, int]) -> str:
    """A parameter's items come in step_memory's order: the weight, its FSDP gathers, its optimizer states,
    then its gradient's items."""
    if not persistent:
        return "activations"
    seen = whole_step.get(item.node, 0)
    if item.start == 0 and item.end == end and seen < 2:
        whole_step[item.node] = seen + 1
        return "parameters" if seen == 0 else "optimizer state"
    return "gradients" if seen >= 2 else "parameters"
