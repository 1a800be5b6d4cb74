"""DTensor's own sharding rules, asked for every legal way to run one ATen node.

DTensor registers a strategy function for most ATen ops (pointwise, views, reductions,
matmuls, embedding, ...): given each input's candidate placements it enumerates
(input placements -> output placements) that run correctly on local shards. Reusing them
gives autojigsaw the op coverage DTensor users already rely on. The API is private, so
this file is the only one that touches it (torch is pinned to one minor release).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Sequence

import torch
import torch.distributed.tensor._ops.utils as _dtensor_op_utils
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._api import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import (
    OpSchema,
    OpSpec,
    OpStrategy,
    TupleStrategy,
)
from torch.distributed.tensor._ops.single_dim_strategy import (
    _expand_single_dim_strategy_to_mesh,
)
from torch.fx import Node
from torch.utils import _pytree as pytree

from ..ir import with_local_tensors
from ..mesh import MeshSpec, RankView
from ..placements import Placements, local_shape, normalize

_PROPAGATOR = DTensor._op_dispatcher.sharding_propagator
_aten = torch.ops.aten
# Kernels that refuse an empty input, as torch.chunk leaves the last ranks (6 channels over 4: 2, 2, 2, 0).
_NO_EMPTY_INPUT = {_aten._native_batch_norm_legit_functional.default, _aten._native_batch_norm_legit.default,
                   _aten.native_batch_norm.default}
# Writes through a list of indices (self, indices, values): DTensor's rule takes a boolean mask for one
# dim, where it covers as many dims as it has (x[mask] = v with a [batch, frames] mask covers both).
_INDEX_PUT = {_aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default}


def has_rule(op) -> bool:
    return op in _PROPAGATOR.op_strategy_funcs or op in _PROPAGATOR.op_single_dim_strategy_funcs


def _meta(val: torch.Tensor) -> TensorMeta:
    return TensorMeta(val.shape, val.stride(), val.dtype)


def dtensor_strategies(
    node: Node, mesh: MeshSpec, candidates: dict[Node, Sequence[Placements]]
) -> list[tuple[tuple[Placements, ...], tuple[Placements | None, ...]]] | None:
    """(input placements, output placements) pairs DTensor allows for `node`, or None.

    `candidates` maps each tensor input node to the placements it may arrive in. Inputs
    are in the order of `tensor_inputs(node)`; outputs one per tensor output.
    """
    if not has_rule(node.target):
        return None
    with _unpriced():
        pairs = _strategies_of(node, mesh, candidates)
    if pairs and node.target in _NO_EMPTY_INPUT:
        shape = node.args[0].meta["val"].shape
        pairs = [(ins, outs) for ins, outs in pairs
                 if all(math.prod(local_shape(shape, ins[0], mesh.sizes, c)) > 0
                        for c in itertools.product(*map(range, mesh.sizes)))] or None
    if pairs and node.target in _INDEX_PUT:
        masked = _mask_covered_dims(node.args[1])
        pairs = [(ins, outs) for ins, outs in pairs
                 if not any(isinstance(p, Shard) and p.dim in masked for p in ins[0])] or None
    return pairs


def _mask_covered_dims(indices) -> set[int]:
    """The dims of `self` that boolean masks among index_put's `indices` cover (each its ndim dims)."""
    covered, dim = set(), 0
    for index in indices:
        val = index.meta.get("val") if isinstance(index, Node) else None
        mask = val is not None and val.dtype == torch.bool
        if mask:
            covered.update(range(dim, dim + val.ndim))
        dim += val.ndim if mask else 1
    return covered


def _strategies_of(node: Node, mesh: MeshSpec, candidates: dict[Node, Sequence[Placements]]):
    pairs = _ask(node, mesh, candidates)
    if pairs is not None:
        return pairs
    # Some rules trip over one unusual candidate (e.g. a view of a Partial): ask per candidate.
    multi = next((src for src, c in candidates.items() if len(c) > 1), None)
    if multi is None:
        return None
    found = []
    for c in candidates[multi]:
        found += _ask(node, mesh, {**candidates, multi: [c]}) or []
    return found or None


@contextlib.contextmanager
def _unpriced():
    """DTensor prices each strategy's redistributions as it lists them; autojigsaw prices its own."""
    price = _dtensor_op_utils.redistribute_cost
    _dtensor_op_utils.redistribute_cost = lambda current, target: 0.0
    try:
        yield
    finally:
        _dtensor_op_utils.redistribute_cost = price


def _ask(node: Node, mesh: MeshSpec, candidates: dict[Node, Sequence[Placements]]):
    """One call of DTensor's rule for `node`; None if the rule rejects these candidates."""
    op = node.target
    dmesh = mesh.fake_device_mesh
    single_dim = op in _PROPAGATOR.op_single_dim_strategy_funcs

    def to_strategy(arg):
        if isinstance(arg, Node) and arg in candidates:
            val = arg.meta["val"]
            meta = _meta(val)
            # Single-dim rules enumerate every layout themselves; they only need to see
            # which kind of shard the inputs use, from exactly one example placement.
            layouts = [_example(val.ndim, mesh.ndim)] if single_dim else candidates[arg]
            return OpStrategy([OpSpec(DTensorSpec(dmesh, p, meta)) for p in layouts])
        if isinstance(arg, Node):
            return arg.meta.get("val")
        return arg

    args, kwargs = pytree.tree_map(to_strategy, (node.args, node.kwargs))
    args = [TupleStrategy(a) if isinstance(a, (list, tuple)) and a and
            all(isinstance(x, OpStrategy) for x in a) else a for a in args]
    info_table = (_PROPAGATOR.op_to_schema_info_for_single_dim_strategy if single_dim
                  else _PROPAGATOR.op_to_schema_info)
    schema = OpSchema(op, tuple(args), kwargs, schema_info=info_table.get(op))
    try:
        if single_dim:
            info = _PROPAGATOR.op_single_dim_strategy_funcs[op]
            out_meta = _output_meta(node.meta["val"])
            expand = _expand_single_dim_strategy_to_mesh(dmesh, schema, info, out_meta)
            result = expand(op, schema.args_meta, schema.kwargs_meta)
        else:
            result = _PROPAGATOR.op_strategy_funcs[op](schema)
    except Exception:  # noqa: BLE001 - a rule that rejects these inputs: no strategy
        return None
    if not isinstance(result, OpStrategy):
        return None
    n_inputs = len([a for a in pytree.tree_leaves((node.args, node.kwargs)) if a in candidates])
    pairs = []
    for op_spec in result.strategies:
        outputs = op_spec.output_specs if isinstance(op_spec.output_specs, tuple) else (op_spec.output_specs,)
        out_pl = tuple(_placements(o) for o in outputs)
        ins = op_spec.input_specs if op_spec.input_specs is not None else [op_spec.output_spec] * n_inputs
        in_pl = tuple(_placements(s) for s in ins[:n_inputs])
        if len(in_pl) == n_inputs and None not in in_pl:
            pairs.append((in_pl, out_pl))
    return pairs


def _example(tensor_ndim: int, mesh_ndim: int) -> Placements:
    first = Shard(0) if tensor_ndim else Replicate()
    return (first,) + (Replicate(),) * (mesh_ndim - 1)


def _output_meta(val):
    if isinstance(val, torch.Tensor):
        return _meta(val)
    return tuple(_meta(v) if isinstance(v, torch.Tensor) else None for v in val)


def _placements(tensor_spec) -> Placements | None:
    if tensor_spec is None:
        return None
    ndim = len(tensor_spec.tensor_meta.shape) if tensor_spec.tensor_meta is not None else None
    pl = tuple(tensor_spec.placements)
    return normalize(pl, ndim) if ndim else pl


def local_call(node: Node, rank: RankView, inputs: tuple[Placements, ...],
               outputs: tuple[Placements | None, ...], tensor_args: list) -> tuple[object, tuple, dict]:
    """The (op, args, kwargs) that compute this rank's shard, as DTensor's dispatch would.

    Shape arguments of views and factories become this rank's output shape; squeezes keep
    only globally singleton dims. `tensor_args` replace the node's tensor inputs, in order.
    """
    op, args, kwargs = node.target, list(node.args), dict(node.kwargs)
    if op in _PROPAGATOR.op_to_shape_and_stride_idx:
        index = _PROPAGATOR.op_to_shape_and_stride_idx[op]
        shape_idx, stride_idx = index if isinstance(index, tuple) else (index, None)
        local = local_shape(node.meta["val"].shape, outputs[0], rank.mesh.sizes, rank.coord)
        args[shape_idx] = list(local)
        if stride_idx is not None:
            args[stride_idx] = list(torch.empty(local, device="meta").stride())
    elif op in _PROPAGATOR.squeeze_op_to_dims_variant:
        op, args = _squeeze_global_singletons(node)
    elif op in _PROPAGATOR.op_to_scalar_shape_adjuster:
        dmesh = rank.fake_device_mesh
        tensor_nodes = [a for a in args if isinstance(a, Node)]
        specs = [DTensorSpec(dmesh, p, _meta(a.meta["val"])) for p, a in zip(inputs, tensor_nodes)]
        it = iter(specs)
        schema = OpSchema(op, tuple(next(it) if isinstance(a, Node) else a for a in args), kwargs)
        local = _PROPAGATOR.op_to_scalar_shape_adjuster[op](specs, schema)
        args = [a if isinstance(a, Node) else b for a, b in zip(args, local.args_schema)]
    args, kwargs = with_local_tensors(args, kwargs, tensor_args)
    return op, args, kwargs


def _squeeze_global_singletons(node: Node):
    """squeeze.dims over the dims of size 1 in the GLOBAL tensor (a shard may be 1 long)."""
    x = node.args[0].meta["val"]
    ndim = x.ndim
    if len(node.args) == 1:
        dims = [d for d in range(ndim) if x.shape[d] == 1]
    else:
        asked = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        dims = [d % ndim for d in asked if x.shape[d % ndim] == 1]
    return _PROPAGATOR.squeeze_op_to_dims_variant[node.target], [node.args[0], dims]
