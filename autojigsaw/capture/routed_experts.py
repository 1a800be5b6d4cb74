"""The routed experts of a mixture-of-experts layer as one op: `autojigsaw::routed_experts`.

Hugging Face's default experts (transformers' `grouped_mm_experts_forward`, used by Mixtral,
Qwen3-MoE, DeepSeek-V3 and others) compute, from the tokens X [T, H] and the router's top-k
experts `index` [T, k] and scores `weights` [T, k]:

    expert_ids, perm = sort(index.flatten());  rows = X[perm // k]          (dispatch, by expert)
    offs = cumsum(histc(expert_ids, E))                                      (rows per expert)
    y = grouped_mm(act(grouped_mm(rows, W1, offs)) [* up], W2, offs)         (the expert MLPs)
    out = (y * weights.flatten()[perm])[inverse(perm)].view(T, k, H).sum(1)  (weighted combine)

capture/expert_region.py finds that region in the captured graph and replaces it with one call of
this op, whose rule (strategies/rules/routed_experts.py) may then split the tokens with the data
and send each to the rank holding its expert (kernels/token_dispatch.py). `routed_experts` below
is the region itself, op for op, so a replicated plan computes what the model computes.
"""

from __future__ import annotations

import torch

NOT_DISPATCHED = "autojigsaw_not_dispatched"  # grouped-matmul meta: why its region is not one routed_experts

# The activations the experts' body may apply (transformers' ACT2FN names), by the ATen call captured.
ACTIVATIONS = {
    "silu": lambda h: torch.ops.aten.silu.default(h),
    "gelu": lambda h: torch.ops.aten.gelu.default(h),
    "gelu_tanh": lambda h: torch.ops.aten.gelu.default(h, approximate="tanh"),
    "relu": lambda h: torch.ops.aten.relu.default(h),
}

_LIB = torch.library.Library("autojigsaw", "FRAGMENT")
_LIB.define("routed_experts(Tensor x, Tensor index, Tensor weights, Tensor w1, Tensor w2, str mm, str act, "
            "bool gated) -> Tensor")
OP = torch.ops.autojigsaw.routed_experts.default


def resolve(op: str):
    """The OpOverload named `op` ("transformers.grouped_mm_fallback.default", "aten._grouped_mm.default")."""
    namespace, name, overload = op.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def expert_mlp(rows: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor, *, mm: str, act: str,
               gated: bool) -> torch.Tensor:
    """Each row through its expert's MLP: `rows` sorted by expert, `offs` the cumulative rows per expert."""
    grouped = resolve(mm)
    h = grouped(rows.to(w1.dtype), w1, offs)
    if gated:
        gate, up = h.chunk(2, dim=-1)
        h = ACTIVATIONS[act](gate) * up
    else:
        h = ACTIVATIONS[act](h)
    return grouped(h.to(w2.dtype), w2, offs)


def rows_per_expert(expert_ids: torch.Tensor, experts: int) -> torch.Tensor:
    """[experts]: how many of `expert_ids` name each expert (float counts, as transformers' histc makes)."""
    ids = expert_ids.float() if expert_ids.device.type in ("cpu", "mps") else expert_ids.int()
    return torch.histc(ids, bins=experts, min=0, max=experts - 1)


def sorted_by_expert(index: torch.Tensor, weights: torch.Tensor):
    """(sorted expert ids, perm, token of each sorted row, score of each sorted row) of the top-k choices."""
    expert_ids, perm = torch.sort(index.reshape(-1))
    return expert_ids, perm, perm // index.shape[1], weights.reshape(-1)[perm]


def combine(y: torch.Tensor, row_weights: torch.Tensor, perm: torch.Tensor, tokens: int, k: int,
            dtype: torch.dtype) -> torch.Tensor:
    """[tokens, H]: the sorted rows' outputs weighted by their scores, back in token order, summed over the k."""
    weighted = y * row_weights.unsqueeze(-1)
    inverse = torch.empty_like(perm).index_put((perm,), torch.arange(perm.shape[0], device=perm.device))
    return weighted[inverse].view(tokens, k, y.shape[-1]).sum(dim=1).to(dtype)


def routed_experts(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                   mm: str, act: str, gated: bool) -> torch.Tensor:
    """The routed experts on one device, as transformers computes them (the op's definition)."""
    expert_ids, perm, token, row_weights = sorted_by_expert(index, weights)
    offs = torch.cumsum(rows_per_expert(expert_ids, w1.shape[0]), dim=0, dtype=torch.int32)
    y = expert_mlp(x[token], w1, w2, offs, mm=mm, act=act, gated=gated)
    return combine(y, row_weights, perm, index.shape[0], index.shape[1], x.dtype)


# Composite: autograd, fake and meta tensors see the ops it is made of (as in the captured region).
_LIB.impl("routed_experts", routed_experts, "CompositeImplicitAutograd")
