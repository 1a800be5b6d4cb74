"""torch.export (non-strict) of a model, from meta or sharded state, with errors that name the fix."""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings
from collections.abc import Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.export import ExportedProgram
from torch.fx import GraphModule, config as fx_config
from torch.utils import _pytree as pytree

from ..modules import module_path
from .checkpointing import reentrant_checkpoints_inlined
from .custom_functions import backward_is_derivative, functions_applied
from .host_random import host_draws, refuse_host_draws
from .lowering import LoweringExchangeError, lower

aten = torch.ops.aten
log = logging.getLogger("autojigsaw")


def export(model: torch.nn.Module, args: tuple, kwargs: dict, param_dtype: torch.dtype | None,
           dynamic_shapes=None, lower: Callable[[ExportedProgram], ExportedProgram] = lower
           ) -> tuple[ExportedProgram, list[str]]:
    """torch.export (non-strict) and `lower`ed to ATen, and the reentrant checkpoints traced (the graph then
    holds only for inputs that need a gradient where these did); a ValueError naming the fix if export fails."""
    # On failure torch.export prints the partial graph to stderr: kept for logging.DEBUG instead.
    torch_stderr = io.StringIO()
    applied: dict[type, tuple | None] = {}
    hooked: list[str] = []
    silent: list[str] = []
    written: list[tuple[str, str, str]] = []
    drawn: list[str] = []
    checkpoints: list[str] = []
    torch_logs: list[logging.LogRecord] = []
    try:
        with (_no_kv_cache(model), _distribution_checks_off(), _no_stack_traces(), _torch_logs_kept(torch_logs),
              reentrant_checkpoints_inlined(checkpoints),
              _stand_in_state(model, args, kwargs, param_dtype) as (args, kwargs),
              functions_applied(applied), _tensor_hooks_registered(hooked), _silent_forward_hooks(model, silent),
              _attributes_written(model, written), host_draws(model, drawn), warnings.catch_warnings(),
              contextlib.redirect_stderr(torch_stderr)):
            # torch 2.13's export trips over its own deprecation of LeafSpec: not the user's concern
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
            ep = torch.export.export(model, tuple(args), kwargs, strict=False, dynamic_shapes=dynamic_shapes)
            _detach_no_grad_regions(ep.graph_module)
            ep = lower(ep)
    except LoweringExchangeError:
        raise
    except Exception as e:  # noqa: BLE001 - rewrap whatever export raises
        log.debug("torch.export's output before it failed (the partial graph):\n%s", torch_stderr.getvalue())
        for record in torch_logs:
            log.debug("torch's log while tracing (%s): %s", record.name, record.getMessage())
        raise ValueError(_export_error(model, e)) from e
    sys.stderr.write(torch_stderr.getvalue())
    for record in torch_logs:
        logging.getLogger(record.name).handle(record)
    _refuse_custom_backward(model, applied)
    _refuse_tensor_hooks(model, hooked)
    _refuse_silent_forward_hooks(silent)
    _refuse_attribute_writes(written)
    refuse_host_draws(model, drawn)
    return ep, checkpoints


@contextlib.contextmanager
def _no_stack_traces():
    """Trace without a Python stack per node (torch.fx.config.do_not_emit_stack_traces): a quarter of export's
    time, and autojigsaw names nodes by their modules (nn_module_stack), not by source lines."""
    saved = fx_config.do_not_emit_stack_traces
    fx_config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        fx_config.do_not_emit_stack_traces = saved


def _detach_no_grad_regions(gm: torch.fx.GraphModule) -> None:
    """Detach what each `with torch.no_grad():` block of the forward returns (an EMA teacher, a target).

    Export's training graph keeps such a block as a region run with grad disabled; the decompositions
    inline it and drop the mode, and the gradient flowed through it (the teacher's weights got
    gradients, an input's gradient took that path too). Detached outputs carry none, as under no_grad.
    """
    for node in gm.graph.nodes:
        if (node.op == "call_function" and node.target is torch.ops.higher_order.wrap_with_set_grad_enabled
                and node.args[0] is False):
            region = getattr(gm, node.args[1].target)
            out = region.graph.output_node()
            with region.graph.inserting_before(out):
                out.args = (tuple(region.graph.call_function(aten.detach.default, (v,)) if isinstance(v, torch.fx.Node)
                                  else v for v in out.args[0]),)
            region.recompile()


def refuse_backward_hooks(model: nn.Module) -> None:
    """The captured graph's backward calls no module backward hook, and a parameter parallelize replaces
    keeps none of its own: a hook that changes gradients (Opacus' per-sample clipping, a gradient scale)
    would be dropped with no error, one that reads them would never run. Refused, naming where."""
    for name, module in model.named_modules():
        for kind in ("_backward_hooks", "_backward_pre_hooks"):
            if getattr(module, kind, None):
                raise ValueError(
                    f"module {name or type(model).__name__!r} has a backward hook ({kind.strip('_')[:-1]}): "
                    "autojigsaw runs the model as one captured graph, whose backward calls no module's backward "
                    "hooks, so it would be dropped. Remove it, or register it on the module parallelize returns "
                    "(pmodel.register_full_backward_hook), which runs at every backward")
    if nn.modules.module._global_backward_hooks or nn.modules.module._global_backward_pre_hooks:
        raise ValueError("a global module backward hook is registered (register_module_full_backward_hook): the "
                         "captured graph's backward calls none; remove it before parallelize")
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor) and (p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)):
            raise ValueError(
                f"parameter {name!r} has a gradient hook (register_hook or register_post_accumulate_grad_hook) "
                "registered before parallelize, which replaces the parameter by its shards (a DTensor) and would "
                "drop it: register it after parallelize, on the parameter of the module parallelize returns")


def _ours(module_name: str) -> bool:
    """Code of torch or autojigsaw, not the model's own."""
    return module_name.startswith(("torch.", "autojigsaw."))


@contextlib.contextmanager
def _tensor_hooks_registered(where: list[str]):
    """Record where the model's own code calls Tensor.register_hook while export runs it."""
    original = torch.Tensor.register_hook

    def register_hook(tensor, hook):
        caller = sys._getframe(1)
        if not _ours(caller.f_globals.get("__name__", "")):
            where.append(f"{caller.f_code.co_filename}:{caller.f_lineno}")
        return original(tensor, hook)

    torch.Tensor.register_hook = register_hook
    try:
        yield
    finally:
        torch.Tensor.register_hook = original


@contextlib.contextmanager
def _silent_forward_hooks(model: nn.Module, silent: list[str]):
    """Record the forward (pre-)hooks of the model's modules that return nothing while export runs them:
    what they do besides (collect features, statistics) happens once, on stand-in tensors."""
    saved = []
    for name, module in model.named_modules():
        for kind in ("_forward_pre_hooks", "_forward_hooks"):
            hooks = getattr(module, kind)
            for key, hook in list(hooks.items()):
                if _library_hook(hook):
                    continue
                saved.append((hooks, key, hook))
                hooks[key] = _recording(hook, f"{name or type(model).__name__}.{kind.strip('_')[:-1]}", silent)
    try:
        yield
    finally:
        for hooks, key, hook in saved:
            hooks[key] = hook


def _library_hook(hook) -> bool:
    """A hook of torch's own (FSDP's return what they change; weight_norm's and spectral_norm's compute
    the weight the forward reads) or of Hugging Face's (gradient checkpointing marks the embeddings'
    output as requiring grad)."""
    fn = getattr(hook, "func", hook)  # a functools.partial
    return _library(getattr(fn, "__module__", ""))


def _library(module_name: str) -> bool:
    """Code of torch, autojigsaw or transformers: written for graphs, what it does is in the captured one."""
    return _ours(module_name) or module_name.startswith("transformers.")


def _recording(hook, where: str, silent: list[str]):
    def run(*args, **kwargs):
        result = hook(*args, **kwargs)
        if result is None:
            silent.append(f"{where} {getattr(hook, '__qualname__', type(hook).__name__)}")
        return result

    return run


def _refuse_silent_forward_hooks(silent: list[str]) -> None:
    """A forward hook that returns nothing acts by side effect (it appends features to a list, logs a
    statistic): it ran once, on export's stand-in tensors, and the captured graph never calls it."""
    if silent:
        where, name = silent[0].split(" ", 1)
        module, kind = where.rsplit(".", 1)
        raise ValueError(
            f"module {module!r} has a {kind.replace('_', ' ')} ({name}) that returns nothing: autojigsaw runs the "
            "model as one captured graph, so the hook ran once, on stand-in tensors while the model was captured, "
            "and never runs again (a list it fills would hold stand-ins, then nothing). Return what it collects "
            "from the model's forward, or register it on the module parallelize returns "
            "(pmodel.register_forward_hook), which runs at every call with whole outputs; a hook that changes "
            "the output must return it")


@contextlib.contextmanager
def _attributes_written(model: nn.Module, written: list[tuple[str, str, str]]):
    """Record (module, attribute, file:line) of each attribute the model's own forward sets on its modules
    while export runs it (an auxiliary loss kept as `self.aux_loss`, a call counter); a buffer updated in
    place is not one."""
    names = {id(m): name for name, m in model.named_modules()}
    original = nn.Module.__setattr__

    def setattr_(module, attr, value):
        caller = sys._getframe(1)
        if (id(module) in names and attr not in module._buffers and module.__dict__.get(attr, None) is not value
                and not _library(caller.f_globals.get("__name__", ""))):
            written.append((names[id(module)] or type(model).__name__, attr,
                            f"{caller.f_code.co_filename}:{caller.f_lineno}"))
        original(module, attr, value)

    nn.Module.__setattr__ = setattr_
    try:
        yield
    finally:
        nn.Module.__setattr__ = original


def _refuse_attribute_writes(written: list[tuple[str, str, str]]) -> None:
    """What the forward keeps on a module besides its outputs and buffers is set once, at capture,
    from stand-in tensors: an auxiliary loss read later is a tracing leftover, a counter stands still."""
    if written:
        module, attr, where = written[0]
        raise ValueError(
            f"module {module!r} sets its attribute {attr!r} in its forward ({where}): autojigsaw runs the model as "
            "one captured graph, so that line ran once, on stand-in tensors while the model was captured, and never "
            "runs again. Return the value from the forward (an auxiliary loss: add it to the output or return it "
            "beside it), or keep it in a registered buffer updated in place (self.calls.add_(1))")


def _refuse_tensor_hooks(model: nn.Module, where: list[str]) -> None:
    """Export keeps the forward and drops a gradient hook registered on one of its tensors (a gradient
    reversal, a gradient scale or clip): the gradients would come back unchanged, with no error."""
    if where:
        raise ValueError(
            f"{type(model).__name__}'s forward registers a gradient hook on a tensor (Tensor.register_hook at "
            f"{where[0]}): torch.export keeps the forward and drops the hook, so the parallel model's gradients "
            "would not pass through it. Write the change with ops whose gradient is the one you want (a gradient "
            "times -a, a gradient reversal: (1 + a) * x.detach() - a * x)")


def _refuse_custom_backward(model: nn.Module, applied: dict[type, tuple | None]) -> None:
    """Export keeps a custom autograd.Function's forward and drops its backward: the gradients would be
    the forward ops' (a straight-through round's would be 0, a gradient reversal's the wrong sign),
    with no error. Refused by name, with the rewrite that keeps the gradient, unless its backward is
    its forward's derivative (checked); torch's own pass."""
    custom = sorted(f"{c.__module__}.{c.__qualname__}" for c, args in applied.items()
                    if not _ours(c.__module__) and not backward_is_derivative(c, args))
    if custom:
        raise ValueError(
            f"{type(model).__name__} applies the custom autograd.Function {custom[0]}"
            f"{f' (and {len(custom) - 1} more)' if len(custom) > 1 else ''}: torch.export keeps its forward and drops "
            "its backward, so the parallel model's gradients would be those of the forward's ops, and on seeded inputs "
            "of its shapes they differ from its backward's (or the check could not run it). Write it with ops whose "
            "gradient is the one you want (a straight-through round: x + (torch.round(x) - x).detach(); a gradient "
            "times -a: (1 + a) * x.detach() - a * x)")


_ONE_DTYPE_OPS = (aten.linear.default, aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
                  aten.matmul.default, aten.convolution.default)


def check_operand_dtypes(gm: GraphModule, params: dict[str, str]) -> None:
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


_SCATTERS = (aten.slice_scatter.default, aten.select_scatter.default, aten.diagonal_scatter.default,
             aten.as_strided_scatter.default)


def check_complex_scatter(gm: GraphModule, params: dict[str, str]) -> None:
    """A write into part of a complex tensor (`out[..., :m] = z`, as spectral convolutions write it) becomes
    a *_scatter op, which autograd cannot differentiate in complex dtypes (eager's in-place copy can):
    the parallel model would fail at its first step on every rank. Refused here, by node and module."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "call_function" and node.target in _SCATTERS and isinstance(val, torch.Tensor) \
                and val.is_complex():
            where = module_path(node, params) or "the model"
            raise ValueError(f"node {node.name} ({where}) writes into part of a complex tensor (out[...] = z in the "
                             f"forward), which torch.export turns into {node.target}, and autograd cannot "
                             "differentiate that in complex dtypes. Build the tensor without writing into it: "
                             "torch.nn.functional.pad(z, ...) or torch.cat of the pieces")


def check_dense(args: tuple, kwargs: dict) -> None:
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
    config = getattr(model, "config", None)
    experts = any(type(m).__name__.endswith("Experts") for m in model.modules())
    if experts and getattr(config, "_experts_implementation", None) == "eager":
        fix = (f"{type(model).__name__}'s experts loop in Python over the experts hit (experts_implementation="
               "'eager'): build it with the default experts implementation (grouped_mm), which autojigsaw shards.")
    elif getattr(config, "layerdrop", 0) and model.training and "data-dependent" in text:
        fix = (f"{type(model).__name__}'s LayerDrop (config.layerdrop={config.layerdrop}) decides in Python, at "
               "each step, whether a layer runs, which one captured graph cannot: build it with layerdrop=0.0.")
    elif "data-dependent" not in text and isinstance(e, (TypeError, RuntimeError)):
        fix = (f"{type(model).__name__}'s forward raised this on the example inputs: check that they match its "
               "arguments, shapes and dtypes (run the model on them once); if it runs on them eagerly, "
               "torch.export(strict=False) cannot trace it as written.")
    elif "validate_args=True" in where:
        fix = ("a torch.distributions object made with validate_args=True checks its arguments in Python at every "
               "step, which one captured graph cannot: make it with validate_args=False (autojigsaw turns the "
               "default checks off while it traces).")
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


_TRACE_LOGGERS = ("torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes")


@contextlib.contextmanager
def _torch_logs_kept(records: list[logging.LogRecord]):
    """torch's tracing logs held in `records` while export runs: where it fails (torch logs a failed op's
    traceback at ERROR first), the ValueError says what failed and the records go to logging.DEBUG;
    where it succeeds, they are logged as torch logged them."""
    def keep(record: logging.LogRecord) -> bool:
        records.append(record)
        return False

    loggers = [logging.getLogger(name) for name in _TRACE_LOGGERS]
    for logger in loggers:
        logger.addFilter(keep)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(keep)


@contextlib.contextmanager
def _distribution_checks_off():
    """torch.distributions' argument checks off while tracing (as `python -O` turns them off).

    Each check asks Python whether a tensor satisfies a constraint (scale > 0), which no graph can
    hold: GroupViT's Gumbel noise, a VAE's Normal(mu, sigma).rsample() stopped the capture. The checks
    compute nothing the model uses, so the graph is the model's without them.
    """
    saved = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        torch.distributions.Distribution.set_default_validate_args(saved)


@contextlib.contextmanager
def _no_kv_cache(model: torch.nn.Module):
    """Turn a Hugging Face model's `config.use_cache` off while tracing it, in every config its modules
    hold (T5's decoder stack reads a copy of the model's)."""
    configs = {id(c): c for m in model.modules() if getattr(c := getattr(m, "config", None), "use_cache", False)}
    for config in configs.values():
        config.use_cache = False
    try:
        yield
    finally:
        for config in configs.values():
            config.use_cache = True
