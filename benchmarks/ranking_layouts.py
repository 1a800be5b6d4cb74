"""The models and the layouts benchmarks/ranking.py compares, each imposed through `constraints=`.

Layouts on a 1-D "tensor" mesh (the planner chooses everything a layout leaves open):
- free: no constraints;
- tp_plan: tensor parallelism as transformers writes it -- the model's own `tp_plan` where it
  ships one (Llama), else the Megatron plan in transformers' style names (q/k/v and the first FFN
  linear "colwise", the attention output and the second FFN linear "rowwise");
- data: data parallelism -- every weight Replicate, and no tensor computed from the inputs split on
  any dim but dim 0 (the batch), none computed from the weights alone split at all;
- sequence: sequence parallelism -- every weight Replicate, no tensor computed from the inputs
  split on dim 0 (the batch; the inputs are split on dim 1, their sequence), none computed from
  the weights alone split at all.
The last two are functions of each captured node's candidate strategies (`constraints=` takes a
node name -> a function of a Strategy), built from the captured graph's shapes and data flow.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Replicate, Shard

from autojigsaw.capture import capture
from autojigsaw.ir import STRATEGIES, tensor_inputs
from autojigsaw.mesh import MeshSpec
from autojigsaw.strategies.annotate import annotate

logging.getLogger("transformers").setLevel(logging.ERROR)

MODELS = ("llama", "bert", "vit")
LAYOUTS = ("free", "tp_plan", "data", "sequence")
# Megatron's plan for BERT's and ViT's layers, in transformers' style names (BERT's "output.dense" matches
# both the attention's output projection and the FFN's second linear: both rowwise)
MEGATRON_BERT = {"attention.self.query": "colwise", "attention.self.key": "colwise",
                 "attention.self.value": "colwise", "intermediate.dense": "colwise", "output.dense": "rowwise"}
MEGATRON_VIT = {"attention.q_proj": "colwise", "attention.k_proj": "colwise", "attention.v_proj": "colwise",
                "attention.o_proj": "rowwise", "mlp.fc1": "colwise", "mlp.fc2": "rowwise"}


@dataclass(frozen=True)
class Sized:
    """A model's size: layers, hidden width (FFN 4x), heads, batch, sequence (or image side), vocabulary."""

    layers: int = 2
    hidden: int = 128
    heads: int = 4
    batch: int = 4
    seq: int = 128
    vocab: int = 2048
    image: int = 96
    patch: int = 8


def build(name: str, size: Sized = Sized()):
    """(model in training mode, positional inputs, keyword inputs with labels) of `name`, seeded, no dropout."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(num_hidden_layers=size.layers, hidden_size=size.hidden, intermediate_size=4 * size.hidden,
                  num_attention_heads=size.heads)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, size.vocab, (size.batch, size.seq), generator=g)
    if name == "llama":
        cfg = tf.LlamaConfig(**common, num_key_value_heads=size.heads, vocab_size=size.vocab,
                             max_position_embeddings=size.seq, use_cache=False)
        return tf.LlamaForCausalLM(cfg).train(), (ids,), {"labels": ids}
    if name == "bert":
        cfg = tf.BertConfig(**common, vocab_size=size.vocab, max_position_embeddings=size.seq,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return tf.BertForMaskedLM(cfg).train(), (ids,), {"labels": ids}
    if name == "vit":
        cfg = tf.ViTConfig(**common, image_size=size.image, patch_size=size.patch, num_labels=10,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        pixels = torch.randn(size.batch, 3, size.image, size.image, generator=g)
        return tf.ViTForImageClassification(cfg).train(), (pixels,), {
            "labels": torch.randint(0, 10, (size.batch,), generator=g)}
    raise ValueError(f"unknown model {name!r}; known: {MODELS}")


def tp_plan(name: str, model) -> dict:
    """transformers' tensor-parallel plan of the model: its own (Llama: `model.tp_plan`, the base model's
    layers, the embedding and the LM head), else Megatron's in transformers' style names."""
    if name == "llama":
        return dict(model.tp_plan)
    return dict(MEGATRON_VIT if name == "vit" else MEGATRON_BERT)


def constraints(layout: str, name: str, model, args: tuple, kwargs: dict, ranks: int) -> tuple[dict | None, int]:
    """(the `constraints=` that impose `layout` on model `name` over a tensor axis of `ranks`, None: free;
    how many nodes no strategy of which keeps the layout, left to the planner)."""
    if layout == "free":
        return None, 0
    if layout == "tp_plan":
        return tp_plan(name, model), 0
    if layout in ("data", "sequence"):
        rules, unkept = _activation_rules(model, args, kwargs, ranks, batch_only=layout == "data")
        return {"*": (Replicate(),), **rules}, unkept
    raise ValueError(f"unknown layout {layout!r}; known: {LAYOUTS}")


def _activation_rules(model, args: tuple, kwargs: dict, ranks: int, *, batch_only: bool) -> tuple[dict, int]:
    """(node name -> a function keeping the strategies that keep the layout, for every node some strategy of
    which does; how many nodes none does)."""
    captured = capture(model, args, kwargs)
    annotate(captured.gm, MeshSpec(("tensor",), (ranks,)))
    batch = captured.input_values[0].shape[0]
    batched = _batched(captured.gm, captured.inputs, batch)
    rules, unkept = {}, 0
    for node in captured.gm.graph.nodes:
        if STRATEGIES not in node.meta:
            continue
        keeps = functools.partial(_keeps_layout, _roles_of(node, batched), batch_only)
        if any(keeps(s) for s in node.meta[STRATEGIES]):
            rules[node.name] = keeps
        else:
            unkept += 1
    return rules, unkept


def _batched(gm, inputs: list[str], batch: int) -> set[str]:
    """Names of the nodes whose value holds samples: computed from the inputs (data flow), or of
    `batch` rows (a weight expanded over the batch, as ViT's class token)."""
    found = set(inputs)
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        rows = getattr(val, "shape", ())[:1]
        if any(src.name in found for src, _ in tensor_inputs(node)) or (batch > 1 and tuple(rows) == (batch,)):
            found.add(node.name)
    return found


def _roles_of(node, batched: set[str]) -> tuple:
    """((holds samples?, ndim) per tensor input), ((holds samples?, ndim) per output) of `node`."""
    ins = tuple((src.name in batched, _ndim(src.meta.get("val"), i)) for src, i in tensor_inputs(node))
    val = node.meta.get("val")
    outs = tuple((node.name in batched, getattr(v, "ndim", 0)) for v in (val if isinstance(val, (list, tuple))
                                                                         else (val,)))
    return ins, outs


def _ndim(val, index: int) -> int:
    if isinstance(val, (list, tuple)):
        val = val[index]
    return getattr(val, "ndim", 0)


def _keeps_layout(roles: tuple, batch_only: bool, strategy) -> bool:
    """Whether `strategy` keeps every tensor of samples split -- on dim 0 (`batch_only`), else on a later
    dim (one of 1 dim: not on dim 0) -- and computes no weight-only value split."""
    ins, outs = roles
    for (samples, ndim), placements in [*zip(ins, strategy.inputs), *zip(outs, strategy.outputs)]:
        if placements is None or ndim == 0:
            continue
        p = placements[0]
        if samples and not _sample_split_ok(p, ndim, batch_only):
            return False
    return all(placements is None or samples or ndim == 0 or placements[0].is_replicate()
               for (samples, ndim), placements in zip(outs, strategy.outputs))


def _sample_split_ok(p, ndim: int, batch_only: bool) -> bool:
    if batch_only:
        return p == Shard(0)
    if ndim == 1:
        return not isinstance(p, Shard) and not p.is_partial()
    return isinstance(p, Shard) and p.dim % ndim >= 1
