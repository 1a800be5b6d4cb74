"""Every rank must hold the same weights, inputs and random state: checked per program, then now and then.

The rewritten graph takes each rank's shard of the whole value every rank holds, and a value
replicated over an axis is assumed equal on its ranks. A script that builds the model without
seeding every process alike (or feeds each rank its own batch, or leaves the random generators
apart under dropout) would train a model that is no model, with no error. One exchange of three
float64 sums per tensor, when a program is built, turns that into a ValueError that names the
first tensor that differs. Later calls check the inputs and random state again, ever more rarely.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from ..capture import Captured
from ..ir import draws_random_numbers
from .exchange import from_every_rank
from .init import recorded_draws

SEED = "seed every rank alike (torch.manual_seed(0)) before building the model, or load the same weights"
SAME_INPUTS = ("parallelize takes the whole inputs, the same on every rank, and slices each rank's shard: give every "
               "rank the same batch (a 'data' mesh axis splits it), or pass this rank's shards with input_placements=")
SAME_STREAM = ("the model draws random numbers (dropout), and every rank draws the single-device mask: seed every rank "
               "alike (torch.manual_seed(0)) before the first call, and draw from the default generator alike on every "
               "rank after it (code that runs on one rank only, such as sampling for a log, takes its own "
               "torch.Generator)")


def checks_again(call: int) -> bool:
    """Whether the module's `call`-th call checks again (the 1st is checked when it is built): the
    2nd, 4th, 8th, ... and every 1,024th, so that ranks drifting apart later (a rank that alone draws
    random numbers for a log, a sampler that splits the batch from the second epoch) are caught at
    the cost of a few small exchanges."""
    return call > 1 and (call & (call - 1) == 0 or call % 1024 == 0)


def check_same_values(entries: list[tuple[str, str, torch.Tensor]]) -> None:
    """`entries`: (what, e.g. "parameter 'fc1.weight'", how to fix it, tensor), the same list on every
    rank; a ValueError naming the first whose values differ between ranks."""
    if not entries or dist.get_world_size() == 1:
        return
    mine = torch.stack([_fingerprint(t) for _, _, t in entries]).cpu().tolist()
    gathered = from_every_rank(mine, "the ranks' checksums of their weights and inputs",
                               "A rank stopped, or called the module fewer times than the others: call it alike "
                               "on every rank")
    for k, (what, fix, _) in enumerate(entries):
        apart = [rank for rank, theirs in enumerate(gathered)
                 if not all(_same(a, b) for a, b in zip(theirs[k], gathered[0][k]))]
        if apart:
            raise ValueError(f"{what} differs between rank 0 and ranks {apart}: {fix}")


def _same(a: float, b: float) -> bool:
    """Equal sums, to float64 rounding; two NaNs agree (a NaN in the tensor makes its sum NaN)."""
    return math.isclose(a, b, rel_tol=1e-9) or (math.isnan(a) and math.isnan(b))


def values_to_agree(model: torch.nn.Module, captured: Captured, args: tuple, kwargs: dict, *, weights: bool,
                    whole_inputs: bool) -> list[tuple[str, str, torch.Tensor]]:
    """What every rank must hold alike before a program runs: the weights and buffers (before they are sharded),
    the whole inputs (not shards the caller passes), the random state where the graph draws from it."""
    entries = []
    if weights:
        for fqn, p in model.named_parameters():  # a meta one: the generator state it will be drawn from
            value = recorded_draws(p) if p.is_meta else p
            label = f"parameter {fqn!r}" + (" (the generator state meta_init draws it from)" if p.is_meta else "")
            entries += [(label, SEED, value)] if value is not None else []
        entries += [(f"buffer {fqn!r}", SEED, b) for fqn, b in model.named_buffers() if not b.is_meta]
    if whole_inputs:
        leaves = pytree.tree_leaves((args, kwargs))
        entries += [(f"input {name!r}", SAME_INPUTS, x) for name, x in zip(captured.inputs, leaves)
                    if isinstance(x, torch.Tensor) and not x.is_meta]
    if draws_random(captured.gm):
        entries.append(("the random generators' state", SAME_STREAM, random_state()))
    return entries


def random_state() -> torch.Tensor:
    """The default generators' states (CPU, and the current GPU's where CUDA is up), as one tensor."""
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    return torch.cat(states)


def draws_random(gm: GraphModule) -> bool:
    """Whether the graph has an op that draws from the default generator (dropout, rand, ...)."""
    return any(draws_random_numbers(n) for n in gm.graph.nodes)


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Three float64 sums: of the distinct elements (an expanded stand-in is read once, not at its
    logical size), of the first 1,024, and one that weights each element by its position. Plain sums
    miss moves: a generator's state advanced by one draw (one counter down, another up) and a batch
    whose rows were shuffled sum alike. The weighted sum runs over chunks (each chunk's running sums,
    times its index), so its scratch memory is a small fraction of the tensor, not a copy of it."""
    t = t.detach()
    t = t[tuple(0 if stride == 0 else slice(None) for stride in t.stride())]
    if t.is_complex():
        t = torch.view_as_real(t)
    flat = t.reshape(-1)
    size = min(_CHUNK, max(256, flat.numel() // 64))
    weighted = torch.zeros((), dtype=torch.float64, device=t.device)
    for k, start in enumerate(range(0, flat.numel(), size)):
        weighted += (k + 1) * torch.cumsum(flat[start:start + size], 0, dtype=torch.float64).sum()
    return torch.stack([flat.sum(dtype=torch.float64), flat[:1024].sum(dtype=torch.float64), weighted])


_CHUNK = 1 << 20
