"""Capture: torch.export (non-strict) of the model into an ATen FX graph with shapes in node.meta.

Why export and not symbolic_trace: it captures Hugging Face GPT-2, Llama, BERT and ViT,
works from the meta device, and records every node's fake value ("val") with its shape.
`run_decompositions({})` then lowers composite ops (reshape, flatten, dropout) to the ATen
ops DTensor has rules for, keeps linear / layer_norm / attention whole, and drops dead code.
A Hugging Face model is traced with its KV cache off: the cache is an inference-time output
that no graph can return, and training never reads it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

# Nodes that only check metadata: they would fail on local shards and compute nothing.
_DROPPED = {torch.ops.aten._assert_tensor_metadata.default}
log = logging.getLogger("autojigsaw")


@dataclass
class Captured:
    """The forward graph of a model and what each of its placeholders stands for."""

    gm: GraphModule
    params: dict[str, str]  # placeholder name -> parameter FQN
    buffers: dict[str, str]  # placeholder name -> buffer (or lifted constant) FQN
    constants: dict[str, torch.Tensor]  # placeholder name -> lifted constant tensor
    inputs: list[str]  # placeholder names of the user inputs, in flattened order
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    mutated_buffers: list[str] = field(default_factory=list)  # FQNs the first graph outputs are new values of

    @property
    def input_values(self) -> list:
        """The fake values of the user inputs (tensors carry shape and dtype)."""
        nodes = {n.name: n for n in self.gm.graph.nodes}
        return [nodes[name].meta.get("val") for name in self.inputs]

    @property
    def input_shapes(self) -> list[tuple[int, ...] | None]:
        return [tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in self.input_values]


def capture(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, *,
            param_dtype: torch.dtype | None = None) -> Captured:
    """Export `model(*args, **kwargs)` into an ATen graph; a clear error if export fails.

    `param_dtype`: capture as mixed precision runs the model (FSDP2's MixedPrecisionPolicy):
    floating parameters and inputs in that dtype, buffers in their own.
    """
    kwargs = kwargs or {}
    # On failure torch.export prints the partial graph to stderr: kept for logging.DEBUG instead.
    torch_stderr = io.StringIO()
    try:
        with (_no_kv_cache(model), _stand_in_state(model, args, kwargs, param_dtype) as (args, kwargs),
              warnings.catch_warnings(), contextlib.redirect_stderr(torch_stderr)):
            # torch 2.13's export trips over its own deprecation of LeafSpec: not the user's concern
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
            ep = torch.export.export(model, tuple(args), kwargs, strict=False).run_decompositions({})
    except Exception as e:  # noqa: BLE001 - rewrap whatever export raises
        log.debug("torch.export's output before it failed (the partial graph):\n%s", torch_stderr.getvalue())
        raise ValueError(_export_error(model, e)) from e
    sys.stderr.write(torch_stderr.getvalue())
    sig = ep.graph_signature
    params, buffers, constants, inputs = {}, {}, {}, []
    for spec in sig.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.PARAMETER:
            params[name] = spec.target
        elif spec.kind == InputKind.BUFFER:
            buffers[name] = spec.target
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            buffers[name] = spec.target
            constants[name] = ep.constants[spec.target]
        elif spec.kind == InputKind.USER_INPUT:
            inputs.append(name)
        else:
            raise ValueError(f"unsupported exported input kind {spec.kind} for {name}")
    gm = ep.graph_module
    _merge_tied(gm, params, model)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _DROPPED and not node.users:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    mutated = [spec.target for spec in sig.output_specs if spec.kind == OutputKind.BUFFER_MUTATION]
    return Captured(gm, params, buffers, constants, inputs, ep.call_spec.in_spec, ep.call_spec.out_spec, mutated)


def _export_error(model: torch.nn.Module, e: Exception) -> str:
    """What failed, where in the model's code, and the fix; the partial graph only at logging.DEBUG."""
    text = str(e)
    lines = text.splitlines()
    marker = "The following call raised this error:"
    at = lines.index(marker) if marker in lines else None
    where = "" if at is None else "\n".join(lines[at:at + 3]) + "\n"  # the model's line that failed
    if getattr(getattr(model, "config", None), "_experts_implementation", None) == "eager":
        fix = (f"{type(model).__name__}'s experts loop in Python over the experts hit (experts_implementation="
               "'eager'): build it with the default experts implementation (grouped_mm), which autojigsaw shards.")
    else:
        fix = ("autojigsaw needs a model that torch.export(strict=False) can trace: remove data-dependent "
               "Python control flow, and pass use_cache=False to Hugging Face models.")
    return (f"torch.export could not capture {type(model).__name__}: {type(e).__name__}: "
            f"{lines[0] if lines else ''}\n{where}{fix}\n"
            "(torch.export's partial graph: a logging.DEBUG record on logger 'autojigsaw')")


@contextlib.contextmanager
def _stand_in_state(model: torch.nn.Module, args: tuple, kwargs: dict, param_dtype: torch.dtype | None):
    """Trace with fake stand-ins for meta state, and for every floating parameter in `param_dtype`.

    Meta state and real inputs do not mix in one trace; fake tensors on the inputs' device
    stand in for the meta ones (no memory), and for sharded ones (DTensors, as whole tensors),
    and the originals are put back afterwards. Under
    mixed precision the floating inputs are cast too, as FSDP2 casts forward inputs.
    """
    def replaced(t, is_param: bool) -> bool:
        # DTensors: a model captured again after its parameters were sharded (a new input shape)
        return (t.is_meta or isinstance(t, DTensor)
                or (is_param and param_dtype is not None and t.is_floating_point()))

    state = [(table, name, t) for mod in model.modules()
             for table, is_param in ((mod._parameters, True), (mod._buffers, False))
             for name, t in table.items() if t is not None and replaced(t, is_param)]
    if not state:
        yield args, kwargs
        return
    real = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    device = real[0].device if real else torch.device("cpu")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes: dict[int, torch.Tensor] = {}  # one stand-in per tensor: tied weights stay tied
    for table, name, t in state:
        if id(t) not in fakes:
            cast = param_dtype if isinstance(t, nn.Parameter) and param_dtype and t.is_floating_point() else t.dtype
            with mode:
                fake = torch.empty_strided(t.shape, t.stride(), dtype=cast, device=device)
            fakes[id(t)] = nn.Parameter(fake, t.requires_grad) if isinstance(t, nn.Parameter) else fake
        table[name] = fakes[id(t)]

    def stand_in(x):
        if not isinstance(x, torch.Tensor):
            return x
        if param_dtype is not None and x.is_floating_point():
            x = x.to(param_dtype)
        return mode.from_tensor(x)

    try:
        yield pytree.tree_map(stand_in, (args, kwargs))
    finally:
        for table, name, t in state:
            table[name] = t


@contextlib.contextmanager
def _no_kv_cache(model: torch.nn.Module):
    """Turn a Hugging Face model's `config.use_cache` off while tracing it."""
    config = getattr(model, "config", None)
    if not getattr(config, "use_cache", False):
        yield
        return
    config.use_cache = False
    try:
        yield
    finally:
        config.use_cache = True


def _merge_tied(gm: GraphModule, params: dict[str, str], model: torch.nn.Module) -> None:
    """One placeholder per parameter: tied weights (GPT-2's lm_head) share one placement."""
    first: dict[int, str] = {}
    names = {n.name: n for n in gm.graph.nodes}
    for ph, fqn in list(params.items()):
        key = id(model.get_parameter(fqn))
        if key not in first:
            first[key] = ph
            continue
        names[ph].replace_all_uses_with(names[first[key]])
        gm.graph.erase_node(names[ph])
        del params[ph]
