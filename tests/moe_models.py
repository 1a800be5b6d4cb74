"""Tiny Hugging Face mixture-of-experts models (Mixtral, Qwen3-MoE, DeepSeek-V3) and routings to force on them.

DeepSeek-V3's is the small form of its own config: latent attention (q and kv LoRA ranks, a rotary
part of each head), a dense first layer, then routed experts in groups (the top-scoring groups
first, by the sum of their best two sigmoid scores, then the top-k experts in them) beside a shared
expert. A forced routing gives every token the experts `chosen`: DeepSeek-V3 through its own
score-correction bias (which only steers the choice), the softmax routers through a bias on their
logits (`BiasedRouter`, their own code with the bias added), so the scores still depend on the token.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logging.getLogger("transformers").setLevel(logging.ERROR)

NAMES = ("mixtral", "qwen3_moe", "deepseek_v3")
FORCE = 20.0  # the bias on the chosen experts: no token's own preference outweighs it


class BiasedRouter(torch.nn.Module):
    """A softmax top-k router (Mixtral's, Qwen3-MoE's) whose logits get a bias buffer added."""

    def __init__(self, gate: torch.nn.Module, bias: torch.Tensor):
        super().__init__()
        self.top_k, self.hidden_dim, self.weight = gate.top_k, gate.hidden_dim, gate.weight
        self.register_buffer("bias", bias)

    def forward(self, hidden_states):
        logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight) + self.bias
        probs = torch.softmax(logits.float(), dim=-1)
        top, index = torch.topk(probs, self.top_k, dim=-1)
        return logits, (top / top.sum(dim=-1, keepdim=True)).to(logits.dtype), index


def _config(name: str, experts: int, top_k: int, groups: tuple[int, int]):
    import transformers as tf

    common = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=64, num_experts_per_tok=top_k, use_cache=False)
    if name == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(num_local_experts=experts, **common))
    if name == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(num_experts=experts, moe_intermediate_size=32, head_dim=8,
                                                        norm_topk_prob=True, decoder_sparse_step=1, **common))
    if name == "deepseek_v3":
        cfg = tf.DeepseekV3Config(n_routed_experts=experts, moe_intermediate_size=32, n_shared_experts=1,
                                  n_group=groups[0], topk_group=groups[1], first_k_dense_replace=1,
                                  q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
                                  v_head_dim=8, **{**common, "num_key_value_heads": 4})
        return tf.DeepseekV3ForCausalLM(cfg)
    raise ValueError(f"unknown model {name!r}; known: {NAMES}")


class WithAuxLoss(torch.nn.Module):
    """A causal LM returning its loss on its own tokens, the router's load-balancing loss added."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids, labels=input_ids).loss


def moe_model(name: str, *, experts: int = 8, top_k: int = 2, groups: tuple[int, int] = (4, 2), forced: bool = False,
              batch: int = 4, seq: int = 8, dtype=torch.float32, aux_loss: bool = False):
    """(model, (input_ids,)) in training mode, seeded. `groups`: DeepSeek-V3's (n_group, topk_group).
    `forced`: every router takes a bias on its logits (`route` sets it; zero until then: the model's own
    routing). `aux_loss`: the model returns its language-model loss plus the router's load-balancing loss."""
    torch.manual_seed(0)
    model = _config(name, experts, top_k, groups)
    if forced and name != "deepseek_v3":  # DeepSeek-V3's router has its bias (e_score_correction_bias)
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "top_k"):
                layer.mlp.gate = BiasedRouter(gate, torch.zeros(experts))
    ids = torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(1))
    if aux_loss:
        model.config.output_router_logits, model.config.router_aux_loss_coef = True, 0.1
        model = WithAuxLoss(model)
    return model.train().to(dtype), (ids,)


def route(model: torch.nn.Module, chosen: tuple[int, ...] | None) -> None:
    """Every token of a `forced` model (or of its ParallelModule) routed to the experts `chosen` (None: its own
    routing), by the routers' bias buffers, set in place."""
    biases = [b for fqn, b in model.named_buffers() if fqn.endswith((".gate.bias", ".gate.e_score_correction_bias"))]
    assert biases, "route() needs a model made with moe_model(..., forced=True)"
    with torch.no_grad():
        for bias in biases:
            bias.zero_()
            if chosen is not None:
                assert len(set(chosen)) == len(chosen) <= bias.numel(), (chosen, bias.numel())
                bias[list(chosen)] = FORCE


def routed(model: torch.nn.Module, inputs) -> list[list[int]]:
    """Per MoE layer, the tokens' choices per expert (counted in a forward of the single-device model)."""
    counts = []
    hooks = [layer.mlp.experts.register_forward_pre_hook(
        lambda m, args: counts.append(torch.bincount(args[1].flatten(), minlength=m.num_experts).tolist()))
        for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    with torch.no_grad():
        model(*inputs)
    for hook in hooks:
        hook.remove()
    return counts


def with_dispatch(plan, axes: tuple[str, ...]):
    """`plan` with every routed-experts node's tokens and experts split over `axes` (a token dispatch over
    their group), and the experts' weights (and their transposes) stored so, the other axes as planned."""
    import dataclasses

    from torch.distributed.tensor import Shard

    split = {plan.mesh.axis_index(a) for a in axes}

    def over(placements):
        return tuple(Shard(0) if a in split else p for a, p in enumerate(placements))

    def experts_weight(n):
        return n.kind == "param" and n.module.rsplit(".", 2)[-2:-1] == ["experts"]

    nodes = []
    for n in plan.nodes:
        if n.op == "autojigsaw.routed_experts":
            notes = "; ".join(f"{a}: token dispatch" for a in axes)
            n = dataclasses.replace(n, inputs=tuple(over(p) for p in n.inputs), outputs=(over(n.outputs[0]),),
                                    kernel="routed_experts", note=notes)
        elif experts_weight(n) or (n.op == "aten.transpose" and n.module.endswith(".experts")):
            n = dataclasses.replace(n, inputs=tuple(over(p) for p in n.inputs), outputs=(over(n.outputs[0]),))
        nodes.append(n)
    params = {fqn: over(p) if fqn.rsplit(".", 2)[-2] == "experts" else p for fqn, p in plan.param_placements.items()}
    return dataclasses.replace(plan, nodes=tuple(nodes), param_placements=params)


SEARCHSORTED = "grouped_mm_searchsorted"  # transformers experts implementation registered by `custom_routing`


def searchsorted_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' grouped_mm experts, the offsets found by a binary search of the sorted expert ids instead
    of a histogram: routing code the token dispatch does not recognise, so its grouped matmuls stay as they are."""
    from transformers.integrations.moe import _grouped_linear

    k = top_k_index.shape[-1]
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    experts = torch.arange(self.num_experts, device=expert_ids.device)
    offsets = torch.searchsorted(expert_ids, experts, right=True).to(torch.int32)
    h = _grouped_linear(hidden_states[perm // k], self.gate_up_proj, offsets, is_transposed=self.is_transposed)
    y = _grouped_linear(self._apply_gate(h), self.down_proj, offsets, is_transposed=self.is_transposed)
    y = y * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    inverse = torch.empty_like(perm).index_put((perm,), torch.arange(perm.shape[0], device=perm.device))
    return y[inverse].view(-1, k, y.shape[-1]).sum(dim=1).to(hidden_states.dtype)


def custom_routing(model: torch.nn.Module) -> torch.nn.Module:
    """`model` (a transformers MoE) with its experts computed by `searchsorted_experts_forward`."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS[SEARCHSORTED] = searchsorted_experts_forward
    model.config._experts_implementation = SEARCHSORTED
    return model
