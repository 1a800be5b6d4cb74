"""The captured forward graph: placeholder roles, tied weights, and one graph per input shape."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx import GraphModule
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils import _pytree as pytree

from .causal_masks import causal_masks_as_flags
from .copies import differentiable_copies
from .eager_strides import record_eager_strides
from .expert_region import collapse_routed_experts
from .export import check_complex_scatter, check_dense, check_operand_dtypes, export
from .lowering import lower
from .shapes import ShapeRange, every_dim_auto, needs_grad, shape_range

# Nodes that only check metadata: they would fail on local shards and compute nothing.
_DROPPED = {torch.ops.aten._assert_tensor_metadata.default}


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
    shapes: ShapeRange | None = None  # a symbolic graph's input sizes (capture(dynamic=True)); None: concrete
    # per tensor input, whether it needed a gradient, where the graph holds only for those (a reentrant
    # checkpoint's region has a gradient only if an input of it needs one); None: the graph holds for any
    needs_grad_inputs: tuple[bool, ...] | None = None
    frozen_params: frozenset[str] = frozenset()  # placeholders of the parameters that required no gradient

    @property
    def input_values(self) -> list:
        """The fake values of the user inputs (tensors carry shape and dtype)."""
        nodes = {n.name: n for n in self.gm.graph.nodes}
        return [nodes[name].meta.get("val") for name in self.inputs]

    @property
    def trained_params(self) -> set[str]:
        """Placeholders of the parameters that require a gradient: a frozen one gets none, nor optimizer state."""
        return set(self.params) - self.frozen_params

    @property
    def input_shapes(self) -> list[tuple[int, ...] | None]:
        return [tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in self.input_values]


def capture(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, *,
            param_dtype: torch.dtype | None = None, dynamic: bool = False, lower=lower) -> Captured:
    """Export `model(*args, **kwargs)` into an ATen graph; a clear error if export fails.

    `param_dtype`: capture as mixed precision runs the model (FSDP2's MixedPrecisionPolicy):
    floating parameters and inputs in that dtype, buffers in their own. `dynamic`: every input
    dim `Dim.AUTO`, so the graph holds symbolic sizes where the model allows (Captured.shapes);
    `at_sizes` makes it concrete for one shape. `lower`: ExportedProgram -> the same lowered to ATen
    (lowering.lower: kept per process; runtime/shared_lowering.py's: shared among ranks).
    """
    kwargs = kwargs or {}
    check_dense(args, kwargs)
    auto = None
    if dynamic:
        arguments = inspect.signature(model.forward).bind(*args, **kwargs).arguments  # as export pairs them
        auto = tuple(pytree.tree_map(every_dim_auto, value) for value in arguments.values())
    ep, checkpoints = export(model, args, kwargs, param_dtype, dynamic_shapes=auto, lower=lower)
    sig = ep.graph_signature
    written = [o.target for o in sig.output_specs if o.kind == OutputKind.USER_INPUT_MUTATION]
    if written:
        raise ValueError(f"{type(model).__name__} writes in place into its input(s) {written}: autojigsaw does not "
                         "write results back into inputs; use an out-of-place op (x = x * 2, not x.mul_(2))")
    params, buffers, constants, inputs = {}, {}, {}, []
    for input_spec in sig.input_specs:
        name = input_spec.arg.name
        if input_spec.kind == InputKind.PARAMETER:
            params[name] = input_spec.target
        elif input_spec.kind == InputKind.BUFFER:
            buffers[name] = input_spec.target
        elif input_spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            buffers[name] = input_spec.target
            constants[name] = ep.constants[input_spec.target]
        elif input_spec.kind == InputKind.USER_INPUT:
            inputs.append(name)
        else:
            raise ValueError(f"unsupported exported input kind {input_spec.kind} for {name}")
    gm = ep.graph_module
    check_operand_dtypes(gm, params)
    check_complex_scatter(gm, params)
    differentiable_copies(gm)
    _merge_tied(gm, params, model)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _DROPPED and not node.users:
            gm.graph.erase_node(node)
    collapse_routed_experts(gm)
    if not dynamic:  # a symbolic graph's mask has no value to check; its plan names the same nodes at every size
        causal_masks_as_flags(gm)
    gm.graph.lint()
    gm.recompile()
    mutated = [o.target for o in sig.output_specs if o.kind == OutputKind.BUFFER_MUTATION]
    frozen = frozenset(ph for ph, fqn in params.items() if not model.get_parameter(fqn).requires_grad)
    captured = Captured(gm, params, buffers, constants, inputs, ep.call_spec.in_spec, ep.call_spec.out_spec, mutated,
                        frozen_params=frozen)
    if checkpoints:
        captured.needs_grad_inputs = needs_grad(pytree.tree_leaves((args, kwargs)))
    if dynamic:
        captured.shapes = shape_range(captured.input_values, args, kwargs, ep.range_constraints)
    else:
        record_eager_strides(gm, _strides(inputs, args, kwargs))
    return captured


def at_sizes(symbolic: Captured, args: tuple, kwargs: dict | None = None) -> Captured:
    """The symbolic graph at the sizes of these inputs: every size a constant, every shape concrete,
    node names as in the symbolic graph, so that one plan names the nodes of every shape."""
    graph, env = torch.fx.Graph(), {}
    for node in symbolic.gm.graph.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    gm = GraphModule(symbolic.gm, graph)
    renamed = {old.name: new.name for old, new in env.items()}  # the copy renames what shadows a builtin ("input")
    params, buffers = ({renamed[k]: v for k, v in table.items()} for table in (symbolic.params, symbolic.buffers))
    constants = {renamed[k]: v for k, v in symbolic.constants.items()}
    inputs = [renamed[name] for name in symbolic.inputs]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    users = iter(pytree.tree_leaves((tuple(args), kwargs or {})))
    feeds = []
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        if node.name in inputs:
            x = next(users)
            if isinstance(x, torch.Tensor):
                with mode:  # in the dtype the graph computes in (mixed precision casts floating inputs)
                    x = mode.from_tensor(x).to(node.meta["val"].dtype)
            feeds.append(x)
        elif node.name in constants:
            feeds.append(mode.from_tensor(constants[node.name]))
        else:  # parameters and buffers: their sizes are the model's, never symbolic
            val = node.meta["val"]
            with mode:
                feeds.append(torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device))
    output_meta = dict(graph.output_node().meta)
    try:
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*feeds)
    except Exception as e:  # noqa: BLE001 - the model's own shape error, from whichever op
        shapes = [tuple(x.shape) for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        raise ValueError(f"the model cannot run inputs of shapes {shapes}: {type(e).__name__}: "
                         f"{str(e).splitlines()[0]}; pass inputs of sizes it accepts") from e
    graph.output_node().meta = output_meta  # as export leaves it: the output node holds no value
    for node in list(graph.nodes):  # sizes, their arithmetic and the checks on them become constants
        node.meta.pop("tensor_meta", None)  # export's, of symbolic sizes
        val = node.meta.get("val")
        if node.op == "call_function" and (val is None or isinstance(val, (int, float, bool))):
            for user in list(node.users):
                user.args, user.kwargs = pytree.tree_map_only(torch.fx.Node, lambda a: val if a is node else a,
                                                              (user.args, user.kwargs))
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
    record_eager_strides(gm, _strides(inputs, args, kwargs or {}))
    return replace(symbolic, gm=gm, params=params, buffers=buffers, constants=constants, inputs=inputs, shapes=None,
                   frozen_params=frozenset(renamed[k] for k in symbolic.frozen_params))


def _strides(inputs: list[str], args: tuple, kwargs: dict) -> dict[str, tuple[int, ...]]:
    """Placeholder name -> the strides of the tensor the caller passes for it."""
    leaves = pytree.tree_leaves((tuple(args), kwargs))
    return {name: tuple(x.stride()) for name, x in zip(inputs, leaves) if isinstance(x, torch.Tensor)}


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
