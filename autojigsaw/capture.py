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
import inspect
import io
import logging
import sys
import warnings
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx import GraphModule
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils import _pytree as pytree

from .modules import module_path

aten = torch.ops.aten
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
    shapes: ShapeRange | None = None  # a symbolic graph's input sizes (capture(dynamic=True)); None: concrete

    @property
    def input_values(self) -> list:
        """The fake values of the user inputs (tensors carry shape and dtype)."""
        nodes = {n.name: n for n in self.gm.graph.nodes}
        return [nodes[name].meta.get("val") for name in self.inputs]

    @property
    def input_shapes(self) -> list[tuple[int, ...] | None]:
        return [tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in self.input_values]


def capture(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, *,
            param_dtype: torch.dtype | None = None, dynamic: bool = False) -> Captured:
    """Export `model(*args, **kwargs)` into an ATen graph; a clear error if export fails.

    `param_dtype`: capture as mixed precision runs the model (FSDP2's MixedPrecisionPolicy):
    floating parameters and inputs in that dtype, buffers in their own. `dynamic`: every input
    dim `Dim.AUTO`, so the graph holds symbolic sizes where the model allows (Captured.shapes);
    `at_sizes` makes it concrete for one shape.
    """
    kwargs = kwargs or {}
    _check_dense(args, kwargs)
    auto = None
    if dynamic:
        arguments = inspect.signature(model.forward).bind(*args, **kwargs).arguments  # as export pairs them
        auto = tuple(pytree.tree_map(_every_dim_auto, value) for value in arguments.values())
    ep = _export(model, args, kwargs, param_dtype, dynamic_shapes=auto)
    sig = ep.graph_signature
    written = [spec.target for spec in sig.output_specs if spec.kind == OutputKind.USER_INPUT_MUTATION]
    if written:
        raise ValueError(f"{type(model).__name__} writes in place into its input(s) {written}: autojigsaw does not "
                         "write results back into inputs; use an out-of-place op (x = x * 2, not x.mul_(2))")
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
    _check_operand_dtypes(gm, params)
    _merge_tied(gm, params, model)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _DROPPED and not node.users:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    mutated = [spec.target for spec in sig.output_specs if spec.kind == OutputKind.BUFFER_MUTATION]
    captured = Captured(gm, params, buffers, constants, inputs, ep.call_spec.in_spec, ep.call_spec.out_spec, mutated)
    if dynamic:
        captured.shapes = _shape_range(captured, args, kwargs, ep.range_constraints)
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
    return replace(symbolic, gm=gm, params=params, buffers=buffers, constants=constants, inputs=inputs, shapes=None)


@dataclass(frozen=True)
class SymbolicSize:
    """An input size export kept symbolic: one value wherever `name` occurs, in [low, high]."""

    name: str
    low: int
    high: int | None  # None: unbounded

    def admits(self, size: int) -> bool:
        return self.low <= size and (self.high is None or size <= self.high)

    def __str__(self) -> str:
        return f"{self.name} in [{self.low}, {'inf)' if self.high is None else f'{self.high}]'}"


@dataclass(frozen=True)
class ShapeRange:
    """The input shapes one graph serves: per tensor input, each dim a fixed size or a SymbolicSize.

    Read off torch.export with every input dim `Dim.AUTO`: export keeps a dim symbolic when the
    model's code works for any size in its range, and fixes it otherwise.
    """

    structure: str  # the call's pytree structure, as a string
    dims: tuple[tuple[int | SymbolicSize, ...] | None, ...]  # per flat input; None: not a tensor
    dtypes: tuple[torch.dtype | None, ...]

    def admits(self, args: tuple, kwargs: dict) -> bool:
        """Whether inputs like these fit: same structure and dtypes, fixed sizes equal, each symbol
        one size everywhere and within its range."""
        flat, spec = pytree.tree_flatten((args, kwargs))
        if str(spec) != self.structure or len(flat) != len(self.dims):
            return False
        seen: dict[str, int] = {}
        for x, dims, dtype in zip(flat, self.dims, self.dtypes):
            if dims is None:
                continue
            if not isinstance(x, torch.Tensor) or x.dtype != dtype or x.ndim != len(dims):
                return False
            for size, dim in zip(x.shape, dims):
                if isinstance(dim, int) and size != dim:
                    return False
                if isinstance(dim, SymbolicSize) and (seen.setdefault(dim.name, size) != size or not dim.admits(size)):
                    return False
        return True

    @property
    def symbolic(self) -> bool:
        return any(isinstance(d, SymbolicSize) for dims in self.dims if dims for d in dims)

    def __str__(self) -> str:
        """e.g. "(s0, s1) with s0 in [2, inf), s1 in [2, 512]" for the token ids of a BERT."""
        tensors = [dims for dims in self.dims if dims is not None]
        shapes = ", ".join("(" + ", ".join(str(getattr(d, "name", d)) for d in dims) + ")" for dims in tensors)
        symbols = {d.name: d for dims in tensors for d in dims if isinstance(d, SymbolicSize)}
        return f"{shapes} with {', '.join(map(str, symbols.values()))}" if symbols else shapes


def _shape_range(captured: Captured, args: tuple, kwargs: dict, ranges) -> ShapeRange:
    """The input sizes of a graph exported with `Dim.AUTO`: fixed, or a symbol and its range."""
    flat, spec = pytree.tree_flatten((tuple(args), kwargs))
    dims = tuple(tuple(_size(n, ranges) for n in val.shape) if isinstance(val, torch.Tensor) else None
                 for val in captured.input_values)
    return ShapeRange(str(spec), dims, tuple(x.dtype if isinstance(x, torch.Tensor) else None for x in flat))


def _every_dim_auto(x):
    return {d: torch.export.Dim.AUTO for d in range(x.ndim)} if isinstance(x, torch.Tensor) else None


def _size(size, ranges) -> int | SymbolicSize:
    if isinstance(size, int):
        return size
    expr = size.node.expr
    if not expr.is_symbol or expr not in ranges:  # a derived size (2 * s0): fixed at this value
        return int(size.node.hint)
    bound = ranges[expr]
    return SymbolicSize(str(expr), int(bound.lower), int(bound.upper) if bound.upper.is_Integer else None)


def _export(model: torch.nn.Module, args: tuple, kwargs: dict, param_dtype: torch.dtype | None,
            dynamic_shapes=None) -> torch.export.ExportedProgram:
    """torch.export (non-strict) and decompositions; a ValueError naming the fix if export fails."""
    # On failure torch.export prints the partial graph to stderr: kept for logging.DEBUG instead.
    torch_stderr = io.StringIO()
    try:
        with (_no_kv_cache(model), _stand_in_state(model, args, kwargs, param_dtype) as (args, kwargs),
              warnings.catch_warnings(), contextlib.redirect_stderr(torch_stderr)):
            # torch 2.13's export trips over its own deprecation of LeafSpec: not the user's concern
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
            ep = torch.export.export(model, tuple(args), kwargs, strict=False, dynamic_shapes=dynamic_shapes)
            ep = ep.run_decompositions({})
    except Exception as e:  # noqa: BLE001 - rewrap whatever export raises
        log.debug("torch.export's output before it failed (the partial graph):\n%s", torch_stderr.getvalue())
        raise ValueError(_export_error(model, e)) from e
    sys.stderr.write(torch_stderr.getvalue())
    return ep


_ONE_DTYPE_OPS = (aten.linear.default, aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
                  aten.matmul.default, aten.convolution.default)


def _check_operand_dtypes(gm: GraphModule, params: dict[str, str]) -> None:
    """A matmul or convolution of tensors of different dtypes (integer inputs to a float layer)
    traces on fake tensors but fails on every rank: refused here, by node and module."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _ONE_DTYPE_OPS:
            continue
        dtypes = [a.meta["val"].dtype for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        if len(set(dtypes)) > 1:
            where = module_path(node, params) or "the model"
            raise ValueError(f"node {node.name} ({where}) runs {node.target} on tensors of dtypes "
                             f"{[str(d) for d in dtypes]}: it needs one dtype; cast the input to the weights' dtype "
                             "(x.float()), or pass integer ids through an embedding")


def _check_dense(args: tuple, kwargs: dict) -> None:
    """Only strided (dense) tensors can be sharded: a sparse input is refused by name."""
    for path, value in pytree.tree_flatten_with_path((tuple(args), kwargs))[0]:
        if isinstance(value, torch.Tensor) and value.layout != torch.strided:
            where = ("args" if path[0].idx == 0 else "kwargs") + pytree.keystr(path[1:])
            raise ValueError(f"input {where} is a {value.layout} tensor: autojigsaw shards dense tensors only; "
                             "pass it dense (.to_dense())")


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
