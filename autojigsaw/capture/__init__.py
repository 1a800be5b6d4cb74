"""Capture: torch.export (non-strict) of the model into an ATen FX graph with shapes in node.meta.

Why export and not symbolic_trace: it captures Hugging Face GPT-2, Llama, BERT and ViT,
works from the meta device, and records every node's fake value ("val") with its shape.
`run_decompositions({})` then lowers composite ops (reshape, flatten, dropout) to the ATen
ops DTensor has rules for, keeps linear / layer_norm / attention whole, and drops dead code.
A Hugging Face model is traced with its KV cache off: the cache is an inference-time output
that no graph can return, and training never reads it.
"""

from .export import refuse_backward_hooks
from .graph import Captured, at_sizes, capture
from .shapes import ShapeRange, SymbolicSize, constant_keys, needs_grad, value_key

__all__ = ["Captured", "ShapeRange", "SymbolicSize", "at_sizes", "capture", "constant_keys", "needs_grad",
           "refuse_backward_hooks", "value_key"]
