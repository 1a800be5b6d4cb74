"""Bad input gets a ValueError that says what is wrong and how to fix it."""

import copy
import random
import re
from random import uniform

import numpy as np
import pytest
import torch
import torch.distributed as dist
from numpy.random import rand
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Replicate, Shard

import autojigsaw
from autojigsaw.plan import format_bytes
from autojigsaw.testing.local_ranks import get_mesh

from .hf_models import hf_model
from .models import MLP, build

X = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))  # the same on every rank


def _plan(**kw):
    kw.setdefault("device", "cpu")
    return autojigsaw.plan(MLP(), (X,), kw.pop("mesh", {"tensor": 2}), **kw)


@pytest.mark.parametrize("mesh,match", [
    ({"tensor": 0}, "axis 'tensor' has size 0"),
    ({}, "one size per axis"),
    ([2, 2], "mapping of axis name to size"),
    ({"tensor": 2.5}, r"axis 'tensor' has size 2.5; sizes are positive ints"),  # int() would plan for 2
    ({"tensor": True}, r"axis 'tensor' has size True"),
])
def test_bad_mesh(mesh, match):
    with pytest.raises(ValueError, match=match):
        _plan(mesh=mesh)


def test_input_placements_for_another_mesh():
    with pytest.raises(ValueError, match=r"2 placements for a mesh of 1 axes.*one placement per mesh axis"):
        _plan(input_placements=[(Shard(0), Replicate())])


def test_input_placement_on_missing_dim():
    with pytest.raises(ValueError, match=r"S\(5\) on axis 'tensor' names a dim the tensor of shape \(2, 5, 16\)"):
        _plan(input_placements=[(Shard(5),)])


def test_budget_too_small_names_largest_tensors():
    with pytest.raises(ValueError, match=r"no plan fits the memory budget.*fc1.weight.*bigger mesh"):
        _plan(memory_budget=1000)


@pytest.mark.parametrize("budget", [-5, 0, float("nan"), float("inf"), "40GB", True])
def test_budget_that_is_no_budget(budget):
    # a negative budget reached the solver as a flipped row and failed an internal assertion
    with pytest.raises(ValueError, match=r"memory_budget=.* is not a budget: give bytes per rank as a positive"):
        _plan(memory_budget=budget)


def test_placement_that_is_no_placement():
    with pytest.raises(ValueError, match=r"input 'x': 'S0' on axis 'tensor' is not a DTensor placement; give Shard"):
        _plan(input_placements=[("S0",)])
    # a string or a lone placement is no tuple of them (a string was read as one placement per character)
    for given in ("S(0)", Shard(0)):
        with pytest.raises(ValueError, match=r"input 'x': .* is not a tuple of placements; give one DTensor placement "
                                             r"per mesh axis \(tensor=2\), e.g. \(Replicate\(\),\)"):
            _plan(input_placements=[given])


@pytest.mark.parametrize("flag", ["training", "tie_layers"])
def test_a_flag_that_is_no_bool(flag):
    # "yes" (or 1) was taken as true without a word
    with pytest.raises(ValueError, match=rf"{flag}='yes': give True"):
        _plan(**{flag: "yes"})


def test_model_that_is_no_module():
    with pytest.raises(ValueError, match=r"must be a torch.nn.Module, got function"):
        autojigsaw.plan(lambda x: x, (X,), {"tensor": 2}, device="cpu")
    with pytest.raises(ValueError, match=r"must be a torch.nn.Module, got function"):
        autojigsaw.parallelize(lambda x: x, {"tensor": 2}, (X,))


def test_unknown_device():
    with pytest.raises(ValueError, match=r"unknown device 'tpu'; known: \['a100', 'a100-40gb', 'cpu', 'h100', 'h100-96gb', 'h200'\]"):
        _plan(device="tpu")


class _DataDependent(torch.nn.Module):
    def forward(self, x):
        return x if x.sum() > 0 else -x


def test_uncapturable_model():
    with pytest.raises(ValueError, match="torch.export could not capture _DataDependent.*data-dependent"):
        autojigsaw.plan(_DataDependent(), (X,), {"tensor": 2})


def test_a_lone_tensor_is_the_one_example_input():
    # tuple(x) of a lone tensor splits its first dim into inputs: with a batch of 1 the plan was for
    # one sample of another rank ((5, 16) here), with no error
    one = X[:1]
    lone, wrapped = (autojigsaw.plan(MLP(), inputs, {"tensor": 2}, device="cpu") for inputs in (one, (one,)))
    assert [n.shape for n in lone.nodes if n.kind == "input"] == [(1, 5, 16)], lone.table()
    assert (lone.step_time, lone.memory_per_rank) == (wrapped.step_time, wrapped.memory_per_rank)


def test_example_inputs_as_a_mapping():
    with pytest.raises(ValueError, match=r"example_inputs must be a tuple of the forward's positional inputs, got a "
                                         r"dict: pass \(x,\) for one input, and keyword inputs as example_kwargs="):
        autojigsaw.plan(MLP(), {"x": X}, {"tensor": 2}, device="cpu")


def test_example_inputs_the_forward_cannot_take(capfd):
    # the failed op's traceback, which torch logs at ERROR before export raises, goes to logging.DEBUG
    with pytest.raises(ValueError, match=r"could not capture MLP: RuntimeError(.|\n)*MLP's forward raised this on "
                                         r"the example inputs: check that they match its arguments, shapes and dtypes"):
        autojigsaw.plan(MLP(), (X[..., :15],), {"tensor": 2}, device="cpu")
    assert "Traceback" not in capfd.readouterr().err


class _CheckedNoise(torch.nn.Module):
    """A VAE's reparameterized sample, its distribution told to check its arguments at every step."""

    def forward(self, x):
        return torch.distributions.Normal(x, x.exp(), validate_args=True).rsample()


def test_distribution_that_checks_its_arguments():
    # the default checks are off while autojigsaw traces (tests/test_model_idioms.py: GroupViT); asked for, they are named
    with pytest.raises(ValueError, match=r"could not capture _CheckedNoise(.|\n)*validate_args=True(.|\n)*make it with "
                                         r"validate_args=False"):
        autojigsaw.plan(_CheckedNoise(), (X,), {"tensor": 2})


def test_parallelize_without_process_group():
    with pytest.raises(ValueError, match="needs a process group.*init_process_group"):
        autojigsaw.parallelize(MLP(), {"tensor": 2}, (X,))


def _wrong_world_size():
    half = DeviceMesh("cpu", [0, 1], mesh_dim_names=("tensor",), _init_backend=False)
    try:
        autojigsaw.parallelize(MLP(), half, (X,), compile=False)
    except ValueError as e:
        return str(e)


def test_mesh_smaller_than_world(ranks4):
    for message in ranks4.run(_wrong_world_size):
        assert "has 2 ranks but the process group has 4" in message


class _Scaled(MLP):
    """The MLP with its input scaled first: the same parameters, a program with one more node."""

    def forward(self, x):
        return super().forward(2 * x)


def _plan_for_other_mesh_and_wrong_inputs():
    mesh = get_mesh((2,), ("tensor",))
    other = autojigsaw.plan(MLP(), (X,), {"tensor": 4}, device="cpu")
    errors = []
    try:
        autojigsaw.parallelize(MLP(), mesh, (X,), compile=False, plan=other)
    except ValueError as e:
        errors.append(str(e))
    # a plan of another model: its parameters (a bare AttributeError from torch's Module before), or its
    # program (the plan's extra nodes were ignored: it ran, priced as another program)
    for other in (MLP(hidden=32), _Scaled()):
        try:
            autojigsaw.parallelize(build("mlp", torch.float32), mesh, (X,), compile=False,
                                   plan=autojigsaw.plan(other, (X,), {"tensor": 2}, device="cpu"))
        except ValueError as e:
            errors.append(str(e))
    # Whole inputs of another shape are planned again (tests/test_shapes.py); local shards cannot be.
    pmodel = autojigsaw.parallelize(build("mlp", torch.float32), mesh, (X,), compile=False,
                                    input_placements=[(Shard(1),)])
    try:
        pmodel(torch.randn(2, 6, 16))
    except ValueError as e:
        errors.append(str(e))
    # a plan of another regime: its casts' nodes were named as another model's; a recomputation asked
    # for beside a plan that has none was dropped without a word
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for plan_kw, kw in (({"mp_policy": bf16}, {}), ({}, {"activation_checkpointing": "full"})):
        try:
            autojigsaw.parallelize(MLP(), mesh, (X,), compile=False,
                                   plan=autojigsaw.plan(MLP(), (X,), {"tensor": 2}, device="cpu", **plan_kw), **kw)
        except ValueError as e:
            errors.append(str(e))
    return errors


def _optimizer_made_before_and_after_parallelize():
    mesh = get_mesh((2,), ("tensor",))
    model = build("mlp", torch.float32)
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    pmodel = autojigsaw.parallelize(model, mesh, (X,), compile=False)
    late = torch.optim.SGD(pmodel.parameters(), lr=0.1)
    before = [p.full_tensor().clone() for p in pmodel.parameters()]
    pmodel(X).square().sum().backward()
    try:
        early.step()
        error = ""
    except ValueError as e:
        error = str(e)
    late.step()  # the optimizer made after parallelize steps the model's shards
    moved = all(not torch.equal(p.full_tensor(), b) for p, b in zip(pmodel.parameters(), before))
    return error, moved


def test_optimizer_made_before_parallelize_is_refused(ranks2):
    # its step changed nothing the model uses: training ran on with the initial weights, silently
    for error, moved in ranks2.run(_optimizer_made_before_and_after_parallelize):
        assert "holds parameter 'fc1.weight' as it was before autojigsaw.parallelize" in error
        assert "create the optimizer after parallelize" in error
        assert moved


class _Dropout(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.nn.functional.dropout(self.fc(x), 0.5)


class _Projected(MLP):
    def __init__(self, projection: torch.Tensor):
        super().__init__()
        self.register_buffer("projection", projection)

    def forward(self, x):
        return super().forward(x @ self.projection)


def _ranks_apart(case: str) -> str:
    rank = dist.get_rank()
    torch.manual_seed(100 + rank if "weights" in case else 0)  # as an unseeded script builds it
    model = _Dropout() if case == "random state" else MLP()
    if case == "meta weights":  # each rank draws its shards from its own generator's state
        with autojigsaw.meta_init():
            model = MLP()
    if case == "buffer":  # a fixed random projection, drawn apart after weights seeded alike
        model = _Projected(torch.randn(16, 16, generator=torch.Generator().manual_seed(rank)))
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(rank if case == "inputs" else 0))
    if case == "random state":
        torch.manual_seed(rank)
    if case == "shuffled inputs" and rank == 1:
        x = x.flip(0)  # the same samples in another order: every plain sum agrees
    later = {"random state later": _Dropout(), "inputs later": MLP()}
    try:
        if case not in later:
            pmodel = autojigsaw.parallelize(model, get_mesh((2,), ("tensor",)), (x,), compile=False)
            pmodel(x)
            return "no error"
        pmodel = autojigsaw.parallelize(later[case], get_mesh((2,), ("tensor",)), (x,), compile=False)
        calls = 0
        for calls in range(1, 5):
            if calls == 2 and rank == 0:  # rank 0 alone samples for a log, or gets its own batch
                torch.rand(1) if case == "random state later" else x.add_(1)
            pmodel(x).sum().backward()
    except ValueError as e:
        return f"at call {calls}: {e}" if case in later else str(e)
    return "no error"


@pytest.mark.parametrize("case,message", [
    ("weights", "parameter 'fc1.weight' differs between rank 0 and ranks [1]: seed every rank alike"),
    ("meta weights", "parameter 'fc1.weight' (the generator state meta_init draws it from) differs between rank 0 "
                     "and ranks [1]: seed every rank alike"),
    ("buffer", "buffer 'projection' differs between rank 0 and ranks [1]: seed every rank alike"),
    ("inputs", "input 'x' differs between rank 0 and ranks [1]: parallelize takes the whole inputs, the same"),
    ("random state", "the random generators' state differs between rank 0 and ranks [1]: the model draws random"),
    ("none", "no error"),
    ("shuffled inputs", "input 'x' differs between rank 0 and ranks [1]"),
    ("random state later", "at call 2: the random generators' state differs between rank 0 and ranks [1]"),
    ("inputs later", "at call 2: input 'x' differs between rank 0 and ranks [1]"),
])
def test_ranks_that_hold_different_values_are_refused(ranks2, case, message):
    # each rank took its shard of its own values, and replicated weights drifted apart: no error, no model
    for error in ranks2.run(_ranks_apart, case):
        assert error.startswith(message), error


def test_plan_for_another_mesh_model_and_inputs_of_another_shape(ranks2):
    for errors in ranks2.run(_plan_for_other_mesh_and_wrong_inputs):
        assert "made for mesh tensor=4 but the module runs on tensor=2" in errors[0]
        assert ("the plan was made for another model (3 parameter(s) differ; fc1.bias is (32,) in the plan and "
                "(64,) in the model") in errors[1]
        assert "the plan has nodes this model's program does not (mul): it was made for another model" in errors[2]
        assert "input 'x' has shape (2, 6, 16) but the plan expects this rank's shard of shape" in errors[3]
        assert errors[4].startswith("the plan was made for precision 'bf16 compute, fp32 masters, fp32 gradient "
                                    "sums' but parallelize is given 'model dtype': pass the mp_policy"), errors[4]
        assert errors[5].startswith("activation_checkpointing='full' but the plan recomputes none: a plan decides"), \
            errors[5]


def _parameter_assigned_after_parallelize() -> str:
    model = build("mlp", torch.float32)
    pmodel = autojigsaw.parallelize(model, get_mesh((2,), ("tensor",)), (X,), compile=False)
    name, param = next(iter(pmodel.named_parameters()))
    owner, _, leaf = name.rpartition(".")
    setattr(pmodel.get_submodule(owner), leaf, torch.nn.Parameter(torch.zeros(param.shape)))
    try:
        pmodel(X)
    except ValueError as e:
        return str(e)
    return ""


def test_parameter_assigned_after_parallelize_is_named(ranks2):
    # a bare AttributeError ('Parameter' object has no attribute 'to_local') from the forward before
    for error in ranks2.run(_parameter_assigned_after_parallelize):
        assert re.match(r"parameter '\w+\.weight' is a plain Parameter of shape \(\d+, \d+\), not the DTensor "
                        r"parallelize made of it \(placed \{'tensor': (Shard\(dim=\d\)|Replicate\(\))\}", error), error
        assert "Assign it before parallelize, or set its values in place" in error, error


class _RoundThrough(torch.autograd.Function):
    """A straight-through round, as quantization-aware training writes it: round forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Quantized(torch.nn.Module):
    def __init__(self, rewritten: bool = False):
        super().__init__()
        self.fc1, self.fc2, self.rewritten = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16), rewritten

    def forward(self, x):
        h = 4 * self.fc1(x)
        h = h + (torch.round(h) - h).detach() if self.rewritten else _RoundThrough.apply(h)
        return self.fc2(torch.relu(h / 4))


def _refused_then_rewritten(ref: torch.nn.Module) -> dict:
    """parallelize's error on `ref` (float64, its `rewritten` flag off), and how far the parallel gradients
    of its rewritten copy are from `ref`'s own on one device."""
    x = X.double()
    try:
        autojigsaw.parallelize(copy.deepcopy(ref), get_mesh((2,), ("tensor",)), (x,), compile=False)
        refused = "no error"
    except ValueError as e:
        refused = str(e)
    rewritten = copy.deepcopy(ref)
    rewritten.rewritten = True
    pmodel = autojigsaw.parallelize(rewritten, get_mesh((2,), ("tensor",)), (x,), compile=False)
    pmodel(x).square().sum().backward()
    ref(x).square().sum().backward()
    grad = max((p.grad.full_tensor() - q.grad).abs().max().item() for p, q in zip(pmodel.parameters(), ref.parameters()))
    return {"refused": refused, "rewritten grad": grad}


def _straight_through() -> dict:
    torch.manual_seed(0)
    ref = _Quantized().double()
    return {**_refused_then_rewritten(ref), "fc1 grad": ref.fc1.weight.grad.abs().max().item()}


def test_custom_autograd_function_is_refused_and_its_rewrite_trains(ranks2):
    # export kept round() and dropped the identity backward: fc1's gradients were 0, with no error
    for r in ranks2.run(_straight_through):
        assert r["refused"].startswith("_Quantized applies the custom autograd.Function tests.test_errors._RoundThrough:"), r
        assert "x + (torch.round(x) - x).detach()" in r["refused"]
        assert r["rewritten grad"] <= 1e-12 and r["fc1 grad"] > 0.1, r  # the rewrite's gradient is the Function's


class _Reversed(torch.nn.Module):
    """A gradient reversal, as domain-adversarial training writes it: a hook that scales the gradient by -a."""

    def __init__(self, rewritten: bool = False):
        super().__init__()
        self.fc1, self.fc2, self.rewritten = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16), rewritten

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        if self.rewritten:
            h = 1.5 * h.detach() - 0.5 * h
        elif h.requires_grad:
            h.register_hook(lambda g: -0.5 * g)
        return self.fc2(h)


def _gradient_hook() -> dict:
    torch.manual_seed(0)
    return _refused_then_rewritten(_Reversed().double())  # on one device the hook runs


def test_gradient_hook_in_the_forward_is_refused_and_its_rewrite_trains(ranks2):
    # export dropped the hook: fc1's gradients came back unreversed (6.8 off in a probe), with no error
    for r in ranks2.run(_gradient_hook):
        assert re.match(r"_Reversed's forward registers a gradient hook on a tensor \(Tensor.register_hook at "
                        r".*test_errors.py:\d+\)", r["refused"]), r
        assert "(1 + a) * x.detach() - a * x" in r["refused"], r
        assert r["rewritten grad"] <= 1e-12, r  # the rewrite's gradient is the hook's


def _triple(grad):
    return 3 * grad


def _halve_input_grads(module, grad_input, grad_output):
    return tuple(None if g is None else 0.5 * g for g in grad_input)


def _hooked(where: str) -> torch.nn.Module:
    """The float64 MLP with a gradient hook: on a module's backward, or on fc1.weight."""
    torch.manual_seed(0)
    model = build("mlp", torch.float64)
    if where == "module":
        model.fc2.register_full_backward_hook(_halve_input_grads)
    elif where == "parameter":
        model.fc1.weight.register_hook(_triple)
    return model


def _backward_hooks() -> dict:
    """The errors of hooks parallelize would drop, and how far gradients with a hook on the parallel
    module's parameter are from one device's."""
    x, mesh = X.double(), get_mesh((2,), ("tensor",))
    errors = {}
    for where in ("module", "parameter"):
        try:
            autojigsaw.parallelize(_hooked(where), mesh, (x,), compile=False)
            errors[where] = "no error"
        except ValueError as e:
            errors[where] = str(e)
    ref, pmodel = _hooked("parameter"), autojigsaw.parallelize(_hooked("none"), mesh, (x,), compile=False)
    pmodel.fc1.weight.register_hook(_triple)
    pmodel(x).square().sum().backward()
    ref(x).square().sum().backward()
    errors["after"] = max((p.grad.full_tensor() - q.grad).abs().max().item()
                          for p, q in zip(pmodel.parameters(), ref.parameters()))
    return errors


def test_backward_hooks_parallelize_would_drop_are_refused(ranks2):
    # a module's backward hook and a parameter's hook registered before were dropped: gradients 0.6 and 2.0
    # off in probes, with no error
    for r in ranks2.run(_backward_hooks):
        assert r["module"].startswith("module 'fc2' has a backward hook (backward_hook): autojigsaw runs the "
                                      "model as one captured graph"), r
        assert r["parameter"].startswith("parameter 'fc1.weight' has a gradient hook"), r
        assert "register it after parallelize" in r["parameter"], r
        assert r["after"] <= 1e-12, r  # the hook registered on the parallel module's parameter runs


class _Spectral(torch.nn.Module):
    """A Fourier neural operator's spectral convolution: a complex weight on the lowest modes."""

    def __init__(self, write_into_slice: bool = True):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4, 3, 3, dtype=torch.cfloat))
        self.lift, self.write_into_slice = torch.nn.Conv2d(3, 4, 1), write_into_slice

    def forward(self, x):
        f = torch.fft.rfft2(self.lift(x))
        low = torch.einsum("bixy,ioxy->boxy", f[:, :, :3, :3], self.w)
        if self.write_into_slice:
            out = torch.zeros_like(f)
            out[:, :, :3, :3] = low
        else:
            out = torch.nn.functional.pad(low, (0, f.shape[-1] - 3, 0, f.shape[-2] - 3))
        return torch.fft.irfft2(out, s=x.shape[-2:])


SPECTRAL_X = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))


def test_complex_write_into_a_slice_is_refused():
    # slice_scatter has no complex autograd: a bare RuntimeError on every rank at the first forward
    with pytest.raises(ValueError, match=r"node slice_scatter \(the model\) writes into part of a complex tensor .*"
                                         r"torch.nn.functional.pad"):
        autojigsaw.plan(_Spectral(), (SPECTRAL_X,), {"tensor": 2}, device="cpu")


def _fsdp_of_mixed_dtypes() -> str:
    torch.manual_seed(0)
    try:
        autojigsaw.parallelize(_Spectral(write_into_slice=False), get_mesh((2,), ("data",)), (SPECTRAL_X,),
                               compile=False)
    except ValueError as e:
        return str(e)
    return ""


def test_fsdp_of_parameters_of_two_dtypes_is_refused(ranks2):
    # FSDP2's own AssertionError: 'FSDP expects uniform original parameter dtype'
    for error in ranks2.run(_fsdp_of_mixed_dtypes):
        assert error.startswith("data_parallel='fsdp' on mesh axis 'data' shards the parameters as one group of "
                                "one dtype, but they have dtypes ['torch.complex64', 'torch.float32'] ('w' is "
                                "torch.complex64)"), error
        assert "data_parallel='ddp'" in error, error


def _feature_model(hook) -> torch.nn.Module:
    """A two-layer MLP whose hidden layer runs `hook` (None: none), its second layer weight-normed the
    old way (torch.nn.utils.weight_norm: a forward pre-hook of torch's that computes the weight)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.utils.weight_norm(torch.nn.Linear(32, 16)))
    if hook is not None:
        model[1].register_forward_hook(hook)
    return model


def test_forward_hook_that_collects_is_refused():
    # a feature-collecting hook ran once, at capture, and appended a FakeTensor; then never again
    feats = []
    with pytest.raises(ValueError, match=r"module '1' has a forward hook \(.*<lambda>\) that returns nothing: .*"
                                         r"register it on the module parallelize returns") as e:
        autojigsaw.plan(_feature_model(lambda m, i, o: feats.append(o)), (X,), {"tensor": 2}, device="cpu")
    assert "a hook that changes the output must return it" in str(e.value)
    # hooks that return what they change, torch's weight_norm pre-hook and Hugging Face's gradient
    # checkpointing hook (it marks the embeddings' output as requiring grad) are captured into the graph
    autojigsaw.plan(_feature_model(lambda m, i, o: o * 0.5), (X,), {"tensor": 2}, device="cpu")
    model, inputs = hf_model("gpt2")
    model.gradient_checkpointing_enable()
    autojigsaw.plan(model.train(), inputs, {"tensor": 2}, device="cpu")


class _KeepsAuxLoss(torch.nn.Module):
    """A mixture-of-experts idiom: the forward keeps its auxiliary loss on the module (`kind` "attribute")
    or counts its calls in a buffer updated in place ("buffer", which export captures)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind, self.fc = kind, torch.nn.Linear(16, 16)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        h = self.fc(x)
        if self.kind == "attribute":
            self.aux_loss = h.square().mean()
        else:
            self.calls += 1
        return h


def test_attribute_set_in_the_forward_is_refused():
    # the attribute held a tracing leftover: a bare SymFloat TypeError, then "backward through the graph a
    # second time" at every step; a counter kept as a Python int stood still at 0
    with pytest.raises(ValueError, match=r"module '_KeepsAuxLoss' sets its attribute 'aux_loss' in its forward "
                                         r"\(.*test_errors.py:\d+\): .*Return the value from the forward"):
        autojigsaw.plan(_KeepsAuxLoss("attribute"), (X,), {"tensor": 2}, device="cpu")
    autojigsaw.plan(_KeepsAuxLoss("buffer"), (X,), {"tensor": 2}, device="cpu")


_HOST_RNG = random.Random(0)


class _HostNoise(torch.nn.Module):
    """Noise drawn on the host, as SpecAugment (numpy) or an old LayerDrop (Python's random) draws it."""

    def __init__(self, source: str):
        super().__init__()
        self.source = source
        self.lin = torch.nn.Linear(16, 16)
        self.rng = np.random.default_rng(0)

    def forward(self, x):
        if self.source == "numpy":
            keep = torch.tensor(np.random.rand(*x.shape[:-1]) > 0.5)
        elif self.source == "python":
            keep = torch.tensor(random.random() > 0.5)
        elif self.source == "numpy, imported":
            keep = torch.tensor(rand(*x.shape[:-1]) > 0.5)
        elif self.source == "python, imported":
            keep = torch.tensor(uniform(0, 1) > 0.5)
        elif self.source == "a generator made ahead":
            keep = torch.tensor(self.rng.random(x.shape[:-1]) > 0.5)
        elif self.source == "a module-level generator":
            keep = torch.tensor(_HOST_RNG.random() > 0.5)
        elif self.source == "numpy, made unseeded":
            keep = torch.tensor(np.random.RandomState().rand(*x.shape[:-1]) > 0.5)
        elif self.source == "python, made unseeded":
            keep = torch.tensor(random.Random().random() > 0.5)
        elif self.source == "numpy's default_rng, made unseeded":
            keep = torch.tensor(np.random.default_rng().random(x.shape[:-1]) > 0.5)
        elif self.source == "made seeded":  # the same draws at every step in eager too: the trace's constant is right
            seeded = np.random.RandomState(0), random.Random(1), np.random.default_rng(2)
            assert isinstance(self.rng, np.random.Generator) and isinstance(_HOST_RNG, random.Random)
            keep = torch.tensor((seeded[0].rand() + seeded[1].random() + seeded[2].random()) > 0.5)
        else:
            keep = torch.rand(x.shape[:-1]) > 0.5
        return self.lin(x) * keep.unsqueeze(-1)


@pytest.mark.parametrize("source, call", [
    ("numpy", r"numpy\.random\.rand at .*test_errors.py:\d+"), ("python", r"random\.random at .*test_errors.py:\d+"),
    # drawn past the functions host_draws patches: found by the generator's state
    ("numpy, imported", r"a draw from numpy's global generator \(a function imported by name: from numpy\.random "
                        r"import \.\.\.\)"),
    ("python, imported", r"a draw from Python's global generator \(a function imported by name: from random import "
                         r"\.\.\.\)"),
    ("a generator made ahead", r"a draw from _HostNoise\.rng"),
    ("a module-level generator", r"a draw from (tests\.)?test_errors\._HOST_RNG"),
    # made in the forward without a seed: eager draws from fresh entropy at every step
    ("numpy, made unseeded", r"numpy\.random\.RandomState\(\) without a seed at .*test_errors.py:\d+"),
    ("python, made unseeded", r"random\.Random\(\) without a seed at .*test_errors.py:\d+"),
    ("numpy's default_rng, made unseeded", r"numpy\.random\.default_rng\(\) without a seed at .*test_errors.py:\d+")])
def test_random_draws_outside_torch_are_refused(source, call):
    # the trace kept the one draw made while tracing as a constant: every step reused it, silently
    with pytest.raises(ValueError, match=rf"_HostNoise draws random numbers outside torch in its forward: "
                                         rf"{call}\. .*Draw with torch instead"):
        autojigsaw.plan(_HostNoise(source), (X,), {"tensor": 2}, device="cpu")
    autojigsaw.plan(_HostNoise("torch"), (X,), {"tensor": 2}, device="cpu")  # a graph op, replayed each step


def test_generators_the_forward_seeds_itself_are_traced():
    autojigsaw.plan(_HostNoise("made seeded"), (X,), {"tensor": 2}, device="cpu")


def test_speech_models_say_how_to_train_with_layer_drop_and_spec_augment():
    model, inputs = hf_model("hubert")  # transformers' defaults: layerdrop 0.1, mask_time_prob 0.05
    with pytest.raises(ValueError, match=r"LayerDrop \(config.layerdrop=0.1\).*layerdrop=0.0") as err:
        autojigsaw.plan(model, inputs, {"tensor": 2}, device="cpu")  # torch.rand, then a Python branch
    assert "experts" not in str(err.value)  # it had blamed a Python loop over MoE experts
    model.config.layerdrop = 0.0
    with pytest.raises(ValueError, match=r"HubertForCTC draws random numbers outside torch in its forward: "
                                         r"numpy\.random\.rand at .*modeling_hubert\.py:\d+.*mask_time_indices="):
        autojigsaw.plan(model, inputs, {"tensor": 2}, device="cpu")


def test_layer_drop_drawn_with_pythons_random_is_refused():
    # MusicGen draws LayerDrop with random.uniform: the trace kept one draw, a layer skipped at every step or never
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.MusicgenDecoderConfig(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   ffn_dim=64, num_codebooks=2, max_position_embeddings=64, layerdrop=0.1,
                                   pad_token_id=0, bos_token_id=1)
    ids = torch.randint(0, 32, (4, 8))
    with pytest.raises(ValueError, match=r"random\.uniform at .*modeling_musicgen\.py:\d+.*layerdrop=0\.0"):
        autojigsaw.plan(tf.MusicgenForCausalLM(cfg).train(), (ids,), {"tensor": 2}, device="cpu")


def test_an_fsdp_parameter_is_listed_as_the_shards_it_keeps_and_the_copy_gathered_where_memory_peaks():
    """On data=64 FSDP keeps 1/64 of a weight's fp32 master and Adam states, and gathers a bf16 copy only
    while its unit runs: the error lists both at the peak, not every copy the step ever makes at once."""
    import transformers as tf

    cfg = tf.LlamaConfig(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=32000, use_cache=False)
    with torch.device("meta"):
        model, ids = tf.LlamaForCausalLM(cfg), torch.zeros(64, 128, dtype=torch.long)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with pytest.raises(ValueError) as e:
        autojigsaw.plan(model, (ids,), {"data": 64}, device="h100", example_kwargs={"labels": ids},
                        data_parallel="fsdp", memory_budget=2**20, mp_policy=bf16)
    numel = 32000 * 256
    kept, gathered = format_bytes(numel * (4 + 2 * 4) / 64), format_bytes(numel * 2)  # master + states; bf16 copy
    assert f"model.embed_tokens.weight ({format_bytes(numel * 12 / 64 + numel * 2)}: {kept} kept to the optimizer " \
           f"step, {gathered} in use there)" in str(e.value), str(e.value)
