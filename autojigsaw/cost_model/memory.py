"""Memory facts of single nodes: what an op keeps for backward, which ops alias, optimizer state.

What an op saves for backward is asked of autograd itself: the op runs once on meta tensors
under `saved_tensors_hooks`, and every saved tensor is classified as (a view of) one of its
inputs or outputs, or as extra (statistics, masks). Attention is the exception: on meta it
runs the math path, which saves the whole score matrix; real devices run flash kernels that
save q, k, v, the output and a log-sum-exp row (CPU included), and the mask: a float one as
given, a boolean one as the float copy the op makes of it.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import torch
from torch.fx import Node
from torch.utils import _pytree as pytree

from ..dtypes import carries_grad
from .compute import ATTENTION


@dataclass(frozen=True)
class Optimizer:
    """What an optimizer adds to memory, in parameter-sized tensors per parameter, and what its step streams."""

    name: str
    states: int  # kept from step to step (Adam: exp_avg and exp_avg_sq)
    temporaries: int  # made by its step for one parameter at a time (Adam: sqrt, division)
    passes: int | None = None  # parameter-sized reads and writes of its step; None: a fused or foreach step's

    def __post_init__(self):
        if self.states < 0 or self.temporaries < 0 or (self.passes is not None and self.passes < 0):
            raise ValueError(f"optimizer {self.name!r}: states, temporaries and passes are counts >= 0")

    @property
    def step_passes(self) -> int:
        """Parameter-sized reads and writes per step: a fused or foreach step reads the weight, its gradient and
        the states and writes the weight and the states once each."""
        return 3 + 2 * self.states if self.passes is None else self.passes


OptimizerName = Literal["adam", "adamw", "decoupled_adamw", "sgd", "momentum", "adagrad", "rmsprop"]
OPTIMIZERS = {o.name: o for o in (
    Optimizer("adam", 2, 2), Optimizer("adamw", 2, 2), Optimizer("sgd", 0, 0),
    Optimizer("momentum", 1, 0), Optimizer("adagrad", 1, 1), Optimizer("rmsprop", 1, 1),
    # Composer's DecoupledAdamW (MosaicML's LLM runs): one parameter at a time, one kernel per op: mul_ and add_
    # of exp_avg, mul_ and addcmul_ of exp_avg_sq, sqrt, a division, add_ of eps, addcdiv_ into the weight
    # (2 + 3 + 2 + 3 + 2 + 2 + 2 + 4; its weight decay, 0 in their configs, adds a mul_ of 2)
    Optimizer("decoupled_adamw", 2, 2, passes=20),
)}

# Shape ops that export writes as copies but that return views at run time.
_ALSO_VIEWS = {torch.ops.aten._unsafe_view.default}


def optimizer_spec(optimizer: str | Optimizer) -> Optimizer:
    """An Optimizer by name ("adam", "sgd", ...), or the spec itself."""
    if isinstance(optimizer, Optimizer):
        return optimizer
    key = str(optimizer).lower()
    if key not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}: name one of {sorted(OPTIMIZERS)} or pass "
                         "autojigsaw.cost_model.memory.Optimizer(name, states, temporaries)")
    return OPTIMIZERS[key]


def is_view(node: Node) -> bool:
    """Does the node's output share its first input's storage (a view, alias or getitem)?"""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem or node.target in _ALSO_VIEWS:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    info = schema.returns[0].alias_info
    return info is not None and not info.is_write


@dataclass(frozen=True)
class Saved:
    """What one op keeps from forward to backward: inputs and outputs by index, and extra bytes.

    `extra` is the bytes of other saved tensors per byte of the first output; `converted`: inputs
    the op saves a copy of, made inside it in the first output's dtype (a boolean attention mask).
    """

    inputs: frozenset[int] = frozenset()
    outputs: frozenset[int] = frozenset()
    extra: float = 0.0
    converted: frozenset[int] = frozenset()


def saved_for_backward(node: Node, needs_grad: Callable[[Node], bool] = lambda arg: True) -> Saved:
    """What `node` saves for backward when its floating inputs for which `needs_grad` holds need gradients.

    Which inputs need gradients matters: `q * cos` saves `cos` for q's gradient, and `q` only if
    `cos` needs one too.
    """
    if node.op != "call_function" or is_view(node):
        return Saved()
    if node.target in ATTENTION:
        q = node.args[0].meta["val"]
        lse = 4 / (q.shape[-1] * q.dtype.itemsize)
        mask = _attention_mask(node)
        if mask is None:
            return Saved(frozenset({0, 1, 2}), frozenset({0}), extra=lse)
        if mask.dtype == torch.bool:
            return Saved(frozenset({0, 1, 2}), frozenset({0}), extra=lse, converted=frozenset({3}))
        return Saved(frozenset({0, 1, 2, 3}), frozenset({0}), extra=lse)
    return _probe(node.target, _signature(node.args, needs_grad), _signature(node.kwargs, needs_grad))


def _attention_mask(node: Node) -> torch.Tensor | None:
    """The mask (or bias) tensor an attention node takes (its fourth tensor input), if any."""
    schema = node.target._schema
    for k, arg in enumerate(schema.arguments):
        if arg.name in ("attn_mask", "attn_bias"):
            a = node.args[k] if k < len(node.args) else node.kwargs.get(arg.name)
            v = a.meta.get("val") if isinstance(a, Node) else None
            return v if isinstance(v, torch.Tensor) else None
    return None


def _signature(tree, needs_grad: Callable[[Node], bool]):
    """A hashable description of arguments: tensors by shape, dtype, stride and whether they need a gradient."""
    def one(a):
        if isinstance(a, Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                return ("T", tuple(v.shape), v.dtype, tuple(v.stride()), needs_grad(a))
            return ("V", v if isinstance(v, (int, float, bool)) else None)
        if isinstance(a, (list, tuple)):
            return ("L", tuple(one(x) for x in a))
        if isinstance(a, torch.device):  # the probe runs on meta
            return ("C", torch.device("meta"))
        constant = (int, float, bool, str, torch.dtype, torch.memory_format, torch.layout, type(None))
        return ("C", a if isinstance(a, constant) else repr(a))

    if isinstance(tree, dict):
        return tuple((k, one(v)) for k, v in tree.items())
    return tuple(one(a) for a in tree)


def _rebuild(sig):
    kind, *rest = sig
    if kind == "T":
        shape, dtype, stride, grad = rest
        t = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        return t.requires_grad_() if grad and carries_grad(dtype) else t
    if kind == "L":
        return [_rebuild(s) for s in rest[0]]
    return rest[0]


@lru_cache(maxsize=None)
def _probe(op, args_sig, kwargs_sig) -> Saved:
    args = [_rebuild(s) for s in args_sig]
    kwargs = {k: _rebuild(s) for k, s in kwargs_sig}
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if not any(t.requires_grad for t in tensors):
        return Saved()
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = op(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an op meta cannot run: assume it keeps its inputs
        return Saved(frozenset(range(len(tensors))))
    outs = [o for o in pytree.tree_leaves(out)]
    ins, kept_out, extra, extras = set(), set(), 0, []
    for t in saved:
        i = next((i for i, x in enumerate(tensors) if torch._C._is_alias_of(t, x)), None)
        o = next((j for j, x in enumerate(outs) if isinstance(x, torch.Tensor) and torch._C._is_alias_of(t, x)),
                 None)
        if i is not None:
            ins.add(i)
        elif o is not None:
            kept_out.add(o)
        elif not any(torch._C._is_alias_of(t, x) for x in extras):  # one storage saved twice (log_softmax's
            extras.append(t)  # output, saved again by nll_loss in a cross-entropy) is kept once
            extra += t.numel() * t.element_size()
    first = next((o for o in outs if isinstance(o, torch.Tensor)), None)
    out_bytes = math.prod(first.shape) * first.element_size() if first is not None else 0
    return Saved(frozenset(ins), frozenset(kept_out), extra / out_bytes if out_bytes else 0.0)
