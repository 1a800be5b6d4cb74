"""ParallelModule: what `autojigsaw.parallelize` returns.

Its parameters are DTensors under the model's own names, so optimizers, clip_grad_norm_,
torch.distributed.checkpoint and `.full_tensor()` work unchanged. Its forward feeds the
local shards to the rewritten graph (compiled by default). By default it takes the whole
inputs, the same on every rank, and returns whole outputs.

A model built under `autojigsaw.meta_init()` gets its shards one parameter at a time
(runtime/materialize.py). A mesh axis named "data" (or "dp") is pure data parallelism
(strategies/data_pins.py); with data_parallel="fsdp" parallelize shards the weights over it
with FSDP2 (runtime/fsdp.py). Under mixed precision the parameters stay in fp32 (the
optimizer's masters) and the graph gets low-precision copies of them and of the inputs.
"""

from __future__ import annotations

import copy
import logging
import traceback
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from ..capture import Captured, constant_keys, needs_grad, value_key
from ..ir import ORIGIN
from ..kernels.collectives import CollectiveError
from ..mesh import MeshSpec
from ..plan import Plan
from ..training import data_axes
from .fsdp import FsdpUnits
from .feeds import program_feeds
from .pipeline import PipelineRun, loss_of, split_microbatches, sum_gradients
from .program import Program
from .module_state import PLAIN, changed_state, describe_modes, module_state
from .same_values import check_same_values, checks_again, values_to_agree

log = logging.getLogger("autojigsaw")


_AUTOCAST = ("autojigsaw: a parallelized module called under torch.autocast runs its ops autocast, but its plan "
             "priced the model's dtype, and each rank rounds its partial sums to the autocast dtype before they "
             "are added: for planned mixed precision, pass mp_policy=MixedPrecisionPolicy(param_dtype="
             "torch.bfloat16, reduce_dtype=torch.float32) to parallelize and call it without autocast")


def _not_a_method(model: str, name: str) -> str:
    """Why a ParallelModule does not run `model.name(...)`, and what to do instead."""
    return (f"{model}.{name} is a method of the model: a ParallelModule runs only its forward (call pmodel(...)), "
            "whose weights are sharded. To generate, save or evaluate with the model's own methods, gather the "
            "weights into an unsharded copy: full = torch.distributed.checkpoint.state_dict.get_model_state_dict("
            "pmodel, options=StateDictOptions(full_state_dict=True)), then model.load_state_dict(full) and call "
            f"model.{name}(...) there; a method that changes the model (gradient_checkpointing_enable, "
            "resize_token_embeddings) goes before parallelize")


class ParallelModule(nn.Module):
    """A model sharded over a DeviceMesh by a Plan; call it like the original model.

    Made by `autojigsaw.parallelize`, not by hand: `model` is the user's model, `device_mesh`
    the DeviceMesh, `plan` a given Plan (None: planned), `.plan` the Plan in use, `.program`
    the Program in use and `.programs` every one built (one per input shape and mode).
    `build(model, args, kwargs)` makes the Program (autojigsaw.api's recipe), at construction or
    at the first call; `local_inputs`: the caller passes this rank's shards of the inputs;
    `local_outputs`: the caller asked for output placements and gets this rank's shards (otherwise
    an output the plan leaves sharded, such as logits beside a loss, comes back as a DTensor).

        pmodel = autojigsaw.parallelize(model, mesh, (x,))  # an autojigsaw.ParallelModule
        print(pmodel.plan); pmodel(x).sum().backward()
    """

    def __init__(self, model: nn.Module, device_mesh, build: Callable[[nn.Module, tuple, dict], Program], *,
                 plan: Plan | None = None, local_inputs: bool = False, local_outputs: bool = False):
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        for name, p in model.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, b in model.named_buffers(recurse=False):
            self.register_buffer(name, b)
        object.__setattr__(self, "_model", model)
        self.register_load_state_dict_pre_hook(_whole_values_as_shards)
        self.device_mesh = device_mesh
        self.mesh = MeshSpec.of(device_mesh)
        self.plan = plan
        self._make = build
        self._local_inputs_given = local_inputs
        self._local_outputs = local_outputs
        self._active: Program | None = None  # the program of the last call
        self._units: FsdpUnits | None = None
        self._state: tuple | None = None  # the modules' state the last program was built for
        self._calls = 0  # forward calls, for the checks that ranks still hold the same inputs and random state
        self._programs: dict[tuple, Program] = {}  # one per input shape, as torch.compile caches graphs
        self._pipeline: PipelineRun | None = None  # with a pipe axis: this rank's stages under their schedule

    def use_pipeline(self, run: PipelineRun) -> None:
        """Run this rank's pipeline stages (parallelize's, with a pipe axis): `train_step` steps them."""
        self._pipeline = run
        self._parameters.update(self._model._parameters)  # the model's own, sharded (or dropped: another stage's)

    def train_step(self, *args, **kwargs) -> torch.Tensor:
        """Forward and backward of one step's whole batch, split into the plan's microbatches; the loss.

        The model must return its loss (a scalar, or an output with `.loss`). With a pipe axis the
        stages run under the plan's schedule and the mean loss of the microbatches comes back on
        every rank; without one the microbatches run one after another (gradient accumulation: FSDP
        reduce-scatters each microbatch's gradients into the shards they accumulate in, as torchtitan
        does, never holding them whole; DDP sums once, after the last). Step the optimizer after it.

            loss = pmodel.train_step(ids, labels=ids); opt.step(); opt.zero_grad()
        """
        if self._pipeline is not None:
            return self._pipeline.step(args, kwargs)
        microbatches = self.plan.microbatches if self.plan is not None else 1
        chunks = split_microbatches(args, kwargs, microbatches)
        total = None
        for a, kw in chunks:
            loss = loss_of(self(*a, **kw)) / len(chunks)
            loss.backward()
            part = loss.detach().to(torch.promote_types(loss.dtype, torch.float32))
            total = part if total is None else total + part
        if self.plan.sums_once and self.plan.data_parallel == "ddp":  # DDP's sum, once the microbatches are in
            data = self.mesh.axis_names[data_axes(self.mesh)[0]]
            sum_gradients(list(self.parameters()), self.device_mesh.get_group(data))
        return total

    def build(self, args: tuple, kwargs: dict) -> None:
        """Plan (unless a plan was given), shard and compile for inputs like `args`, `kwargs`.

        Called again for inputs of another shape, it plans that shape with the parameters kept
        where they are (the optimizer's DTensors stay valid) and keeps both programs; a shape in
        the range of a dynamic program (parallelize(dynamic=True)) gets that program's plan.
        """
        # a first call under torch.inference_mode (a check before training) would make every shard an
        # inference tensor, which no later backward can save; the program built runs in any mode
        with torch.inference_mode(False):
            self._build(args, kwargs)

    def _build(self, args: tuple, kwargs: dict) -> None:
        key = self._key(args, kwargs)
        serving = next((p for k, p in self._programs.items()
                        if k[0] == key[0] and k[2] in (None, key[2]) and p.symbolic
                        and p.symbolic.shapes.admits(args, kwargs)), None)
        if not self._programs:
            program = self._make(self._model, args, kwargs)
        elif serving is not None:
            log.info("autojigsaw: input shapes %s run with the plan of %s (dynamic=True)", key[1][-1],
                     serving.symbolic.shapes)
            program = self._make(self._model, args, kwargs, plan=None, pinned=self.plan.param_placements,
                                 reuse=serving, units=self._units)
        else:
            log.info("autojigsaw: planning again for input shapes %s (needing a gradient: %s) in %s%s (parameters "
                     "stay as placed)", key[1][-1], key[2], describe_modes(key[0]),
                     changed_state(self._model, self._state, key[0]))
            program = self._make(self._model, args, kwargs, plan=None, pinned=self.plan.param_placements,
                                 units=self._units)
        if dist.get_rank() == 0:
            log.info(program.plan.summary_line())
        self._keep(key, program)
        # the model's own code may set attributes while export runs it (a rotary cache's length): the next
        # call, from that state, needs no program of its own
        self._state = module_state(self._model)
        self._keep((self._state, *key[1:]), program)
        self._use(program)
        self._units = self._units or program.units
        self._parameters.update(self._model._parameters)  # the model's own, now sharded
        self._buffers.update(self._model._buffers)

    @property
    def program(self) -> Program | None:
        """The Program in use (read-only): `.captured` (the captured graph), `.plan`, `.rank` (this rank's
        view of the mesh), `.graph` (the rewritten graph of local-shard ops and collectives); None before
        the first call of a module parallelize was given no example inputs for.

            print(pmodel.program.graph.code)  # what this rank runs
        """
        return self._active

    @property
    def programs(self) -> tuple[Program, ...]:
        """Every Program built so far, in the order built: one per input shape and module state (train or
        eval mode, ...), each program once however many such keys it serves."""
        return tuple({id(p): p for p in self._programs.values()}.values())

    @property
    def pipeline(self) -> PipelineRun | None:
        """With a pipe axis, this rank's pipeline stages under their schedule (read-only): `.stages`, PyTorch's
        PipelineStage objects, whose `.submod` runs each; None without one."""
        return self._pipeline

    def _use(self, program: Program) -> None:
        self.plan, self.precision = program.plan, program.precision
        # a plain attribute: the graph modules it holds stay out of the module tree (modules(), print, hooks,
        # apply), which is the model's
        object.__setattr__(self, "_active", program)
        self._sharded_outputs = _sharded_beside_loss(program.captured, program.plan)

    # ------------------------------------------------------------ running

    def _key(self, args: tuple, kwargs: dict) -> tuple:
        """The program cache key: what export bakes into the graph. The modules' state (train/eval
        mode, plain attributes such as dropout's p, hooks), the input shapes (not when the caller
        passes local shards: their global shape is the plan's, others are refused clearly), the
        values of the inputs that are no tensors, and which tensor inputs need a gradient (for a
        program only: `_find`)."""
        flat, tree_spec = pytree.tree_flatten((args, kwargs))
        if self._local_inputs_given:
            call = ("local shards", constant_keys(flat))
        else:
            call = (str(tree_spec), tuple(value_key(x) for x in flat))
        return module_state(self._model), call, needs_grad(flat)

    def _find(self, key: tuple) -> Program | None:
        """The program for `key`: one that holds whichever inputs need a gradient, or one captured for
        exactly these (where a reentrant checkpoint's region has a gradient only if its inputs need one)."""
        return self._programs.get((*key[:2], None)) or self._programs.get(key)

    def _keep(self, key: tuple, program: Program) -> None:
        needs = program.captured.needs_grad_inputs
        self._programs[(*key[:2], None if needs is None else key[2])] = program

    def __getattr__(self, name: str):
        """The model's own attributes read through (`pmodel.config`, `pmodel.temperature`), not its methods:
        those would run the model on its sharded weights outside the plan, so they say what to do."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("_model")
            if model is not None and callable(getattr(type(model), name, None)):
                raise AttributeError(_not_a_method(type(model).__name__, name)) from None
            if model is None or name not in model.__dict__:
                raise
            return model.__dict__[name]

    def __setattr__(self, name: str, value) -> None:
        """A plain attribute of the model (`pmodel.temperature = 2.0`) is set on the model, which the
        next call captures again with it; it would otherwise change this wrapper only, silently."""
        model = self.__dict__.get("_model")
        if model is not None and name in model.__dict__ and name not in self.__dict__ and isinstance(value, PLAIN):
            setattr(model, name, value)
        else:
            super().__setattr__(name, value)

    def __getitem__(self, index):
        """The model's item (`pmodel[0]`, `pmodel[-1]` of an nn.Sequential root): the same module, sharded."""
        return self._model[index]

    def __deepcopy__(self, memo: dict) -> ParallelModule:
        """A copy with its own parameters and buffers (an EMA model: copy.deepcopy, AveragedModel) that
        runs this module's programs: they hold no weights, and a copied graph would rename its nodes.
        Refused under FSDP, whose units hold the weights the programs read."""
        if self._units is not None:
            raise RuntimeError("FSDP does not support deepcopy: with data_parallel='fsdp' the programs read the "
                               "weights of this module's FSDP units, so a copy would train the original's. Keep an "
                               "average of the parameters instead (torch._foreach_lerp_(ema, [p.detach() for p in "
                               "pmodel.parameters()], 1 - decay)), or use data_parallel='ddp'")
        model = copy.deepcopy(self._model, memo)
        twin = ParallelModule(model, self.device_mesh, self._make, plan=self.plan,
                              local_inputs=self._local_inputs_given, local_outputs=self._local_outputs)
        twin._programs, twin._state, twin._calls = dict(self._programs), self._state, self._calls
        if self._active is not None:
            twin._use(self._active)
        twin.train(self.training)
        return twin

    def train(self, mode: bool = True) -> ParallelModule:
        """Set the mode of the model's root too (only its children are this module's): the next call
        runs the program captured in that mode, planned on first use with the parameters in place."""
        super().train(mode)
        self._model.train(mode)
        return self

    def forward(self, *args, **kwargs):
        if self._pipeline is not None:
            raise ValueError("with a pipe axis each rank holds only its pipeline stages: train with "
                             "pmodel.train_step(*inputs, **kwargs), which runs every microbatch forward and backward "
                             "and returns the loss; to run the model forward only, load its weights into an "
                             "unsharded copy (torch.distributed.checkpoint.state_dict.get_model_state_dict)")
        if any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda")):
            warnings.warn(_AUTOCAST, stacklevel=2)
        program = self._find(self._key(args, kwargs))
        if program is None:
            self.build(args, kwargs)
        elif program is not self._active:
            self._use(program)
        self._calls += 1
        if checks_again(self._calls):
            check_same_values(values_to_agree(self._model, self._active.captured, args, kwargs, weights=False,
                                              whole_inputs=not self._local_inputs_given))
        captured = self._active.captured
        flat, tree_spec = pytree.tree_flatten((args, kwargs))
        if tree_spec != captured.in_spec:
            raise ValueError(f"the module was planned for inputs structured as {captured.in_spec}, "
                             f"got {tree_spec}; call it as in the example inputs")

        def run():
            return self._active.run(*self._feeds(flat))

        try:
            outs = run() if self._units is None else self._units.run(run)
        except CollectiveError as e:
            node = _failing_node(e, self._active.graph)
            raise CollectiveError(f"{e} (graph node {node!r}, forward)", e.kind, e.axis) from e
        # export returns a buffer's new value (BatchNorm's running statistics) before the outputs
        k = len(captured.mutated_buffers)
        mutated, outs = list(outs[:k]), list(outs[k:])
        with torch.no_grad():
            for name, value in zip(captured.mutated_buffers, mutated):
                self._model.get_buffer(name).copy_(value)
        if self.precision.output_dtype is not None:
            outs = [o.to(self.precision.output_dtype) if isinstance(o, torch.Tensor) and o.is_floating_point() else o
                    for o in outs]
        if not self._local_outputs:
            outs = self._as_dtensors(outs)
        return pytree.tree_unflatten(list(outs), captured.out_spec)

    def _feeds(self, flat: list) -> list:
        """The active program's inputs for the call's flat inputs (runtime/feeds.py)."""
        return program_feeds(self._model, self._active, flat, local_inputs=self._local_inputs_given)

    def _as_dtensors(self, outs: list) -> list:
        """Beside a returned loss, the outputs the plan leaves sharded (logits), as DTensors: whole on
        request (`.full_tensor()`), never mistaken for whole. Other plans' outputs are as asked; where
        some are DTensors, the others take a gradient that comes back as one (the loss plus a term of the
        logits) whole."""
        sharded = {i for i, _, _ in self._sharded_outputs}
        for i, placements, val in self._sharded_outputs:
            outs[i] = DTensor.from_local(outs[i], self.device_mesh, placements, run_check=False,
                                         shape=val.shape, stride=val.stride())
        for i, out in enumerate(outs):
            if sharded and i not in sharded and isinstance(out, torch.Tensor) and out.requires_grad:
                outs[i] = _WholeGradient.apply(out)
        return outs

class _WholeGradient(torch.autograd.Function):
    """Identity; a gradient that arrives as a DTensor (a plain loss added to a DTensor's term makes one)
    goes on as its whole value, as the program's backward takes plain tensors."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.full_tensor() if isinstance(g, DTensor) else g


def _sharded_beside_loss(captured: Captured, plan: Plan) -> list[tuple[int, tuple, torch.Tensor]]:
    """(output index, placements, global value) of each output the plan leaves sharded beside a
    returned scalar loss; none when the model returns no loss. Worked out once per program."""
    out_node = next(n for n in captured.gm.graph.nodes if n.op == "output")
    k = len(captured.mutated_buffers)  # buffers' new values come first, then the outputs
    vals = [getattr(a, "meta", {}).get("val") if a is not None else None for a in out_node.args[0]]
    if not any(isinstance(v, torch.Tensor) and v.ndim == 0 for v in vals[k:]):
        return []
    out, placements = [], iter(plan.output_placements)
    for i, val in enumerate(vals):
        if not isinstance(val, torch.Tensor):
            continue
        pl = next(placements)
        if i >= k and pl is not None and not all(p.is_replicate() for p in pl):
            out.append((i - k, pl, val))
    return out


def _failing_node(error: BaseException, gm: GraphModule) -> str:
    """The rewritten graph's node whose line of `gm.code` was running when `error` was raised,
    with the model node it serves ("all_gather_3 for linear_7"); "?" outside the graph's code."""
    frames = traceback.extract_tb(error.__traceback__)
    for frame in reversed(frames):
        if frame.filename.startswith("<eval_with_key") and frame.lineno and frame.line:
            name = frame.line.split("=")[0].strip()
            node = next((n for n in gm.graph.nodes if n.name == name), None)
            if node is not None:
                return f"{name} for {node.meta.get(ORIGIN, name)}"
    return "?"


def _whole_values_as_shards(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """load_state_dict of a single-device state dict (whole tensors, torch.load's): each rank keeps
    its shard of every value whose parameter is a DTensor, as distribute_tensor slices it, without
    communication (every rank read the same file); DTensor values (torch.distributed.checkpoint's)
    pass as they are."""
    for name, p in module.named_parameters(remove_duplicate=False):  # tied weights: every name
        value = state_dict.get(prefix + name)
        if isinstance(p, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            if tuple(value.shape) != tuple(p.shape):
                continue  # load_state_dict reports the size mismatch itself
            state_dict[prefix + name] = distribute_tensor(value.to(p.device), p.device_mesh, p.placements,
                                                          src_data_rank=None)
