"""Pipeline stages over a "pipe" axis, and gradient accumulation without one, train as the single-device model.

A tiny Llama and GPT-2 (its embedding tied to its head, a copy on each pipe rank that holds a stage
reading it), of 2 to 4 layers (the fewest each case takes), are cut into stages and run under
PyTorch's schedules, alone and beside a tensor axis or an FSDP data axis; the loss, every gradient
and the parameters after two AdamW steps must equal the single-device model's, which trains on the
whole batch: microbatches change only the order of the sums. The models are fp64, but Hugging
Face's causal-LM loss computes in fp32 (`logits.float()`) and Llama's RMSNorm too, so values agree
to fp32 rounding (the tolerance of tests/test_hf_models.py). Under FSDP a stage gathers its weights
once per step and reduce-scatters their gradients once, after its last microbatch (PyTorch's
PipelineStage does so for a stage module that is an FSDP module); counted here. Checkpoints
(torch.distributed.checkpoint) move between a pipelined mesh and one without a pipe axis.
Plans are made once in the test process and sent as JSON.
"""

from __future__ import annotations

import copy
import functools
import re

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import autojigsaw
from autojigsaw import Options, Plan
from autojigsaw.api.pipelines import starts_of
from autojigsaw.capture import capture
from autojigsaw.capture.stages import cut
from autojigsaw.mesh import MeshSpec
from autojigsaw.runtime.pipeline import refuse_fsdp_in_two_stages
from autojigsaw.testing.local_ranks import get_mesh

from . import hf_models  # noqa: F401 -- quiets transformers' logging

TOL = 5e-6  # relative to the largest gradient: a few fp32 roundings through the model
BF16_TOL = 9 * 2.0**-8  # one bf16 rounding more per matmul than the single device (tests/test_training_regime.py)
BATCH, SEQ, VOCAB, MICROBATCHES = 8, 8, 64, 4
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
PIPE = (("pipe", 2),)
PIPE_TENSOR = (("pipe", 2), ("tensor", 2))
PIPE_DATA = (("pipe", 2), ("data", 2))
# per-rank budgets (bytes) by (model, layers) under which every stage must shard its weights over the tensor
# axis: 0.7 of what the stages need on the pipe axis alone (1.08 MB, 0.96 MB)
TENSOR_BUDGET = {("llama", 4): 750_000, ("gpt2", 2): 670_000}
TENSOR = (("tensor", 2),)
# without a pipe axis: 0.7 of what one rank needs with every tensor whole (1.35 MB, 0.76 MB)
ACCUMULATION_BUDGET = {("llama", 4): 950_000, ("llama", 2): 530_000}


def _model(name: str, layers: int = 4, dtype: torch.dtype = torch.float64):
    """(model, ids) of a tiny `name` with seeded weights and inputs, the same on every rank."""
    import transformers as tf

    torch.manual_seed(0)
    if name == "llama":
        cfg = tf.LlamaConfig(num_hidden_layers=layers, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=VOCAB, use_cache=False)
        model = tf.LlamaForCausalLM(cfg)
    else:
        cfg = tf.GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32, use_cache=False,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        model = tf.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return model.to(dtype).train(), ids


@functools.cache
def _plan(name: str, mesh: tuple, layers: int = 4, dtype: torch.dtype = torch.float64, **options) -> str:
    """The plan of `name` on `mesh` ((axis, size) pairs) with `options`, as JSON, made once per test process."""
    model, ids = _model(name, layers, dtype)
    return autojigsaw.plan(model, (ids,), dict(mesh), example_kwargs={"labels": ids}, device="cpu",
                           microbatches=MICROBATCHES, **options).to_json()


def _parallel(name: str, mesh: tuple, plan: str, *, layers: int = 4, dtype: torch.dtype = torch.float64,
              **options):
    """(parallel model, single-device model, ids): the same seeded model twice."""
    ref, ids = _model(name, layers, dtype)
    shape, axes = tuple(s for _, s in mesh), tuple(a for a, _ in mesh)
    pmodel = autojigsaw.parallelize(copy.deepcopy(ref), get_mesh(shape, axes), (ids,), example_kwargs={"labels": ids},
                                    compile=False, plan=Plan.from_json(plan), **options)
    return pmodel, ref, ids


def _adamw(model) -> torch.optim.AdamW:
    """AdamW with eps=1e-2: its step moves a weight by at most lr x its gradient's error / eps. With the default
    1e-8, a gradient near 1e-8 turns its fp32 rounding (3e-11) into a step 5.4e-6 off (Llama on tensor=2, 4
    microbatches), past TOL though the gradients agree to 3e-7 of the largest."""
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-2)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


class _CountCollectives(TorchDispatchMode):
    """Counts FSDP's all-gathers and reduce-scatters: c10d's ops (the program's own are functional ones)."""

    def __init__(self):
        super().__init__()
        self.counts = {"gathers": 0, "reduce_scatters": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("c10d."):
            for key, word in (("gathers", "allgather"), ("reduce_scatters", "reduce_scatter")):
                self.counts[key] += word in name
        return func(*args, **(kwargs or {}))


def _step(pmodel, ref, ids, opt, ref_opt, out: dict) -> None:
    """One AdamW step of both models, the largest differences of the loss and of each gradient kept in `out`,
    FSDP's collectives of the step in out["collectives"]."""
    with _CountCollectives() as comm:
        loss = pmodel.train_step(ids, labels=ids)
    ref_loss = ref(ids, labels=ids).loss
    ref_loss.backward()
    out["loss"] = max(out.get("loss", 0.0), abs(loss.item() - ref_loss.item()))
    out["collectives"] = comm.counts
    grads = out.setdefault("grad", {})
    for fqn, p in sorted(pmodel.named_parameters()):
        q = ref.get_parameter(fqn)
        grads[fqn] = max(grads.get(fqn, 0.0), _diff(_whole(p.grad), q.grad))
        out["scale"] = max(out.get("scale", 0.0), q.grad.abs().max().item())
    opt.step(), ref_opt.step()
    opt.zero_grad(), ref_opt.zero_grad()


def _params(pmodel, ref, out: dict) -> dict:
    """`out` with the largest difference of each parameter this rank holds and the names of all."""
    out["param"] = {fqn: _diff(_whole(p), ref.get_parameter(fqn)) for fqn, p in sorted(pmodel.named_parameters())}
    out["names"] = sorted(n for n, _ in ref.named_parameters())
    return out


def _train(name: str, mesh: tuple, plan: str, *, layers: int = 4, steps: int = 2, save: str | None = None,
           **options) -> dict:
    """`steps` AdamW steps of the parallel model (train_step) and of the single-device one on the whole batch:
    per parameter this rank holds, the largest differences of its gradients and of its values after the steps;
    the loss's; FSDP's collectives in the last step and FSDP's units here. `save`: a DCP checkpoint path, written
    after the steps with the optimizer's state."""
    pmodel, ref, ids = _parallel(name, mesh, plan, layers=layers, **options)
    opt = _adamw(pmodel)
    ref_opt = _adamw(ref)
    out = {}
    for _ in range(steps):
        _step(pmodel, ref, ids, opt, ref_opt, out)
    out["units"] = sum(isinstance(m, FSDPModule) and bool(m._parameters) for m in _fsdp_modules(pmodel))
    if save is not None:
        dcp.save(_state(pmodel, opt), checkpoint_id=save)
        out["saved"] = _full(pmodel)
    return _params(pmodel, ref, out)


def _state(pmodel, opt) -> dict:
    """What a checkpoint holds: the model's and the optimizer's state, by parameter name (flattened: the
    optimizer of each pipe rank holds other parameters)."""
    return {"model": pmodel.state_dict(),
            "optim": get_optimizer_state_dict(pmodel, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))}


def _full(pmodel) -> dict[str, np.ndarray]:
    """Copies of the whole parameters this rank holds, as numpy arrays."""
    return {n: _whole(p.detach()).numpy().copy() for n, p in sorted(pmodel.named_parameters())}


def _resume(name: str, mesh: tuple, plan: str, path: str, steps_before: int, *, save: str | None = None,
            **options) -> dict:
    """Load the checkpoint at `path` (written after `steps_before` steps) into the parallel model and its
    optimizer, then one more step beside the single-device model trained as long: the loaded weights, and the
    differences as `_train` gives them. `save`: a checkpoint written after that step."""
    pmodel, ref, ids = _parallel(name, mesh, plan, **options)
    opt = _adamw(pmodel)
    ref_opt = _adamw(ref)
    for _ in range(steps_before):
        ref(ids, labels=ids).loss.backward()
        ref_opt.step(), ref_opt.zero_grad()
    state = _state(pmodel, opt)
    dcp.load(state, checkpoint_id=path)
    set_optimizer_state_dict(pmodel, opt, state["optim"], options=StateDictOptions(flatten_optimizer_state_dict=True))
    out = {"loaded": _full(pmodel)}
    _step(pmodel, ref, ids, opt, ref_opt, out)
    if save is not None:
        dcp.save(_state(pmodel, opt), checkpoint_id=save)
        out["saved"] = _full(pmodel)
    return _params(pmodel, ref, out)


def _fsdp_modules(pmodel) -> list:
    """The FSDP modules that run this rank's program(s): its pipeline stages' or its program's units."""
    if pmodel.pipeline is not None:
        return [m for stage in pmodel.pipeline.stages for m in stage.submod.modules()]
    units = pmodel.program.units
    return [] if units is None else list(units.root.modules())


def _check(results: list[dict], tol: float = TOL) -> None:
    """Every parameter is held by some rank; the loss, gradients and parameters agree within `tol` x the
    largest gradient."""
    held = set().union(*(r["grad"] for r in results))
    assert held == set(results[0]["names"]), sorted(set(results[0]["names"]) - held)
    bound = tol * max(1.0, max(r["scale"] for r in results))
    for r in results:
        assert r["loss"] <= bound, r["loss"]
        for key in ("grad", "param"):
            worst = max(r[key].items(), key=lambda kv: kv[1])
            assert worst[1] <= bound, (key, worst, bound)


def _sharded_on_tensor(plan: Plan) -> set[str]:
    """The weights some stage splits over the tensor axis."""
    return {fqn for st in plan.pipeline.stages for fqn, pl in st.plan.param_placements.items()
            if not pl[st.plan.mesh.axis_names.index("tensor")].is_replicate()}


def _check_fsdp_once(results: list[dict]) -> None:
    """Each FSDP unit gathered its weights once in the step and reduce-scattered their gradients once."""
    for r in results:
        assert r["units"] > 0 and r["collectives"] == {"gathers": r["units"], "reduce_scatters": r["units"]}, r


def _options(name: str, mesh: tuple, layers: int = 4, **options) -> dict:
    """The options of a case: a tensor axis with the budget that makes it shard, a data axis with FSDP."""
    axes = dict(mesh)
    if "tensor" in axes:
        options["memory_budget"] = (TENSOR_BUDGET if "pipe" in axes else ACCUMULATION_BUDGET)[name, layers]
    if "data" in axes:
        options.setdefault("data_parallel", "fsdp")
    return options


# ---------------------------------------------------------------- schedules, meshes, recomputation

CASES = [  # (model, layers, mesh, schedule, options): each schedule; both models on each mesh (Llama on pipe x
    # tensor in the checkpoint test); 3 layers over 2 stages; recomputation under FSDP; DDP; the fewest layers each
    # takes
    ("llama", 3, PIPE, "1F1B", {}),
    ("gpt2", 4, PIPE, "zero-bubble", {}),
    ("gpt2", 2, PIPE_TENSOR, "gpipe", {}),
    ("llama", 2, PIPE_DATA, "gpipe", {"activation_checkpointing": "full"}),
    ("gpt2", 4, PIPE_DATA, "interleaved", {"virtual_stages": 2, "activation_checkpointing": "selective"}),
    ("llama", 2, PIPE_DATA, "1F1B", {"data_parallel": "ddp"}),  # DDP sums the gradients once, after the schedule
]


@pytest.mark.parametrize("name,layers,mesh,schedule,options", CASES,
                         ids=[f"{c[0]}{c[1]}-{'x'.join(a for a, _ in c[2])}-{c[3]}{'-ddp' * ('data_parallel' in c[4])}"
                              for c in CASES])
def test_pipeline_trains_like_one_device(ranks2, ranks4, name, layers, mesh, schedule, options):
    options = _options(name, mesh, layers, **options)
    plan = Plan.from_json(_plan(name, mesh, layers, pipeline_schedule=schedule, **options))
    assert plan.pipeline.schedule == schedule and plan.pipeline.microbatches == MICROBATCHES
    if layers == 3:
        assert sorted(len(st.layers) for st in plan.pipeline.stages) == [1, 2], plan.pipeline.stages
    if "tensor" in dict(mesh):
        assert _sharded_on_tensor(plan), "the budget lets every stage keep its weights whole"
    if "activation_checkpointing" in options:
        assert len(plan.recompute) == layers, plan.recompute
    results = (ranks4 if len(mesh) == 2 else ranks2).run(_train, name, mesh, plan.to_json(), layers=layers,
                                                         **options)
    _check(results)
    if options.get("data_parallel") == "fsdp":
        _check_fsdp_once(results)


def _train_bf16(name: str, mesh: tuple, plan: str, *, layers: int, **options) -> dict:
    """One step of the model over `mesh` in bf16 with fp32 masters (`options` hold the mp_policy), and of the
    single-device model in bf16 (the same casts, no autocast) and in fp32: the loss's and each gradient's
    differences relative to the largest gradient."""
    pmodel, ref, ids = _parallel(name, mesh, plan, layers=layers, dtype=torch.float32, **options)
    low = copy.deepcopy(ref).to(torch.bfloat16)
    loss = pmodel.train_step(ids, labels=ids)
    low_loss = low(ids, labels=ids).loss
    low_loss.backward()
    ref(ids, labels=ids).loss.backward()  # in fp32
    scale = max(q.grad.abs().max().item() for q in low.parameters())
    grads = {fqn: _diff(_whole(p.grad), low.get_parameter(fqn).grad) / scale for fqn, p in pmodel.named_parameters()}
    return {"loss": abs(loss.item() - low_loss.item()) / abs(low_loss.item()), "grad": grads,
            "dtypes": sorted({str(p.dtype) for p in pmodel.parameters()} | {str(p.grad.dtype) for p in
                                                                               pmodel.parameters()}),
            "names": sorted(n for n, _ in low.named_parameters()),
            "from_fp32": max(_diff(_whole(p.grad), ref.get_parameter(fqn).grad) for fqn, p in pmodel.named_parameters())
            / scale}


def test_bf16_stages_train_like_one_device_in_bf16(ranks4):
    options = _options("llama", PIPE_DATA, mp_policy=BF16)
    plan = _plan("llama", PIPE_DATA, 2, dtype=torch.float32, pipeline_schedule="1F1B", **options)
    results = ranks4.run(_train_bf16, "llama", PIPE_DATA, plan, layers=2, **options)
    assert set().union(*(r["grad"] for r in results)) == set(results[0]["names"])
    for r in results:
        assert r["dtypes"] == ["torch.float32"], r["dtypes"]  # fp32 masters and gradients
        assert r["from_fp32"] > 2.0**-12, r  # farther from the fp32 model than fp32 rounding: computed in bf16
        assert r["loss"] <= BF16_TOL and max(r["grad"].values()) <= BF16_TOL, r


# ---------------------------------------------------------------- gradient accumulation without a pipe axis

ACCUMULATION = [("llama", (("tensor", 2),)), ("gpt2", (("data", 2),))]


@pytest.mark.parametrize("name,mesh", ACCUMULATION, ids=[a for _, ((a, _),) in ACCUMULATION])
def test_gradient_accumulation_without_a_pipe_axis_trains_like_one_device(ranks2, name, mesh):
    options = _options(name, mesh, 2)
    plan = Plan.from_json(_plan(name, mesh, 2, **options))
    assert plan.microbatches == MICROBATCHES and plan.pipeline is None
    if "tensor" in dict(mesh):
        assert any(not pl[0].is_replicate() for pl in plan.param_placements.values()), "weights kept whole"
    results = ranks2.run(_train, name, mesh, plan.to_json(), layers=2, **options)
    _check(results)
    for r in results:
        if "data" in dict(mesh):  # FSDP reduce-scatters each microbatch's gradients: they never stay whole
            assert r["units"] > 0 and r["collectives"]["reduce_scatters"] == r["units"] * MICROBATCHES, r


# ---------------------------------------------------------------- checkpoints


def _reference(name: str, steps: int):
    """The single-device model after `steps` AdamW steps, and its loss at the next."""
    ref, ids = _model(name)
    opt = _adamw(ref)
    for _ in range(steps):
        ref(ids, labels=ids).loss.backward()
        opt.step(), opt.zero_grad()
    return ref, ids


def _assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    for name in want:
        assert np.array_equal(got[name], want[name]), name  # bit-exact


def _merged(results: list[dict], key: str) -> dict:
    return {name: value for r in results for name, value in r[key].items()}


def test_a_checkpoint_moves_between_a_pipe_axis_and_none(ranks2, ranks4, tmp_path):
    # saved on pipe x tensor (each pipe rank writes its stages' weights, DTensors on the tensor axis), loaded on
    # tensor=2 and on one device; saved there after one more step, loaded back on pipe x tensor
    piped, flat = str(tmp_path / "pipe"), str(tmp_path / "flat")
    options = _options("llama", PIPE_TENSOR, virtual_stages=2)
    plan = _plan("llama", PIPE_TENSOR, pipeline_schedule="interleaved", **options)
    assert _sharded_on_tensor(Plan.from_json(plan))
    results = ranks4.run(_train, "llama", PIPE_TENSOR, plan, save=piped, **options)
    _check(results)
    saved = _merged(results, "saved")
    tensor_options = _options("llama", TENSOR)
    resumed = ranks2.run(_resume, "llama", TENSOR, _plan("llama", TENSOR, **tensor_options), piped, 2, save=flat,
                         **tensor_options)
    for r in resumed:
        _assert_equal(r["loaded"], saved)
    _check(resumed)
    dcp_to_torch_save(piped, tmp_path / "full.pt")
    single, ids = _model("llama")
    single.load_state_dict(torch.load(tmp_path / "full.pt", weights_only=False)["model"])
    _assert_equal({n: p.detach().numpy() for n, p in single.named_parameters()}, saved)
    ref, _ = _reference("llama", 2)
    assert abs(single(ids, labels=ids).loss.item() - ref(ids, labels=ids).loss.item()) <= TOL
    back = ranks4.run(_resume, "llama", PIPE_TENSOR, plan, flat, 3, **options)
    _assert_equal(_merged(back, "loaded"), resumed[0]["saved"])
    _check(back)


# ---------------------------------------------------------------- bad input


def _error(call) -> str:
    try:
        call()
    except ValueError as e:
        return str(e)
    return "no error"


def _bad_inputs(plan: str) -> dict[str, str]:
    """The messages of what train_step and forward refuse, with a pipe axis and without; a step after them."""
    model, ids = _model("llama", layers=2)
    mesh = get_mesh((2,), ("pipe",))
    out = {"no inputs": _error(lambda: autojigsaw.parallelize(copy.deepcopy(model), mesh, compile=False)),
           "no loss": _error(lambda: autojigsaw.parallelize(copy.deepcopy(model), mesh, (ids,), compile=False,
                                                            plan=Plan.from_json(plan)))}
    pmodel = autojigsaw.parallelize(model, mesh, (ids,), example_kwargs={"labels": ids}, compile=False,
                                    plan=Plan.from_json(plan))
    out["forward"] = _error(lambda: pmodel(ids, labels=ids))
    out["indivisible"] = _error(lambda: pmodel.train_step(ids[:6], labels=ids[:6]))
    out["other shape"] = _error(lambda: pmodel.train_step(ids[:, :4], labels=ids[:, :4]))
    out["steps after"] = str(torch.isfinite(pmodel.train_step(ids, labels=ids)).item())
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8)).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    flat = autojigsaw.parallelize(mlp, get_mesh((2,), ("tensor",)), (x,), compile=False, microbatches=2)
    out["no loss, no pipe"] = _error(lambda: flat.train_step(x))
    out["indivisible, no pipe"] = _error(lambda: flat.train_step(x[:3]))
    return out


def test_bad_input_is_refused_with_the_fix(ranks2):
    for out in ranks2.run(_bad_inputs, _plan("llama", PIPE, 2, pipeline_schedule="1F1B")):
        assert "pass example_inputs" in out["no inputs"], out
        assert "train_step needs a model that returns its loss" in out["no loss"], out
        assert "pmodel.train_step(*inputs, **kwargs)" in out["forward"], out
        assert "microbatches=4 does not divide the batch of 6" in out["indivisible"], out
        assert "built for inputs of shapes [(8, 8), (8, 8)]" in out["other shape"], out
        assert out["steps after"] == "True", out
        assert "train_step needs a model that returns its loss" in out["no loss, no pipe"], out
        assert "microbatches=2 does not divide the batch of 3" in out["indivisible, no pipe"], out


PLAN_REFUSALS = [  # (mesh, options, what the message says): the model has 2 layers, the batch 8 rows
    ({"pipe": 2}, {"pipeline_schedule": "zero-bubble"},
     "'zero-bubble' runs 2 stages per pipe rank, 4 stages on 2 pipe ranks, but the model has 2 repeated layers"),
    ({"pipe": 2}, {"pipeline_schedule": "interleaved"}, "choose '1F1B' or 'gpipe', or a smaller pipe axis"),
    ({"pipe": 2}, {"pipeline_schedule": "gpipe", "virtual_stages": 2}, "'gpipe' runs 1 stage(s) per pipe rank"),
    ({"pipe": 2, "data": 2}, {"microbatches": 8}, "microbatches=8 does not divide the batch of 4 rows per data"),
    ({"data": 2}, {"microbatches": 8}, "microbatches=8 x 2 ranks of data axis 'data' does not divide the batch of 8"
                                       " (dim 0 of the inputs): give microbatches that do (here: 1, 2, 4)"),
    ({"tensor": 2}, {"microbatches": 3}, "microbatches=3 does not divide the batch of 8"),
    ({"tensor": 2}, {"pipeline_schedule": "1F1B"}, "pipeline_schedule='1F1B' schedules pipeline stages, and mesh"),
    ({"tensor": 2}, {"virtual_stages": 2}, "has no pipe axis: name a mesh axis 'pipe' (or 'pp'), or drop virtual"),
]


def test_plans_that_cannot_run_are_refused_with_the_fix():
    model, ids = _model("llama", layers=2)
    for mesh, options, message in PLAN_REFUSALS:
        with pytest.raises(ValueError, match=re.escape(message)):
            autojigsaw.plan(model, (ids,), mesh, example_kwargs={"labels": ids}, device="cpu", **options)


def test_fsdp_refuses_a_weight_two_stages_of_one_rank_read():
    # zero-bubble's V puts the first and the last stage on pipe rank 0: GPT-2's tied embedding and head
    plan = Plan.from_json(_plan("gpt2", PIPE, pipeline_schedule="zero-bubble"))
    model, ids = _model("gpt2")
    captured = capture(model, (ids[:2],), {"labels": ids[:2]})
    programs = cut(captured, starts_of(plan, captured))
    regime = Options(data_parallel="fsdp").regime(MeshSpec(("data",), (2,)))
    with pytest.raises(ValueError, match=r"'transformer.wte.weight' is read by stages \[0, 3\], which pipe rank 0 "
                                         r"both runs under 'zero-bubble'.*data_parallel='ddp'"):
        refuse_fsdp_in_two_stages(plan.pipeline, [set(p.captured.params.values()) for p in programs], regime,
                                  MeshSpec(("data",), (2,)))
