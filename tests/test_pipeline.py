"""Pipeline stages over a "pipe" axis, and gradient accumulation without one, train as the single-device model.

A 4-layer Llama and GPT-2 (its embedding tied to its head, a copy on each pipe rank that holds a stage
reading it) are cut into stages and run under PyTorch's schedules, alone and beside a tensor axis or an
FSDP data axis; the loss, every gradient and the parameters after two AdamW steps must equal the
single-device model's, which trains on the whole batch: microbatches change only the order of the sums.
The models are fp64, but Hugging Face's causal-LM loss computes in fp32 (`logits.float()`) and Llama's
RMSNorm too, so values agree to fp32 rounding (the tolerance of tests/test_hf_models.py). Under FSDP a
stage gathers its weights once per step and reduce-scatters their gradients once, after its last
microbatch (PyTorch's PipelineStage does so for a stage module that is an FSDP module); counted here.
Checkpoints (torch.distributed.checkpoint) move between a pipelined mesh and one without a pipe axis.
Plans are made once in the test process and sent as JSON.
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import autojigsaw
from autojigsaw import Plan
from autojigsaw.testing.local_ranks import get_mesh

from . import hf_models  # noqa: F401 -- quiets transformers' logging

TOL = 5e-6  # relative to the largest gradient: a few fp32 roundings through the model
BF16_TOL = 9 * 2.0**-8  # one bf16 rounding more per matmul than the single device (tests/test_training_regime.py)
BATCH, SEQ, VOCAB, MICROBATCHES = 8, 8, 64, 4
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
PIPE = (("pipe", 2),)
PIPE_TENSOR = (("pipe", 2), ("tensor", 2))
PIPE_DATA = (("pipe", 2), ("data", 2))
# per-rank budgets (bytes) under which every stage must shard its weights over the tensor axis: 0.7 of
# what each model's stages need on the pipe axis alone (1.08 MB, 1.73 MB)
TENSOR_BUDGET = {"llama": 750_000, "gpt2": 1_200_000}


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


def _train(name: str, mesh: tuple, plan: str, *, layers: int = 4, steps: int = 2, save: str | None = None,
           **options) -> dict:
    """`steps` AdamW steps of the parallel model (train_step) and of the single-device one on the whole batch:
    per parameter this rank holds, the largest differences of its gradients and of its values after the steps;
    the loss's; FSDP's collectives in the last step and FSDP's units here. `save`: a DCP checkpoint path."""
    pmodel, ref, ids = _parallel(name, mesh, plan, layers=layers, **options)
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    out = {"loss": 0.0, "grad": {}, "param": {}, "scale": 0.0}
    for _ in range(steps):
        with _CountCollectives() as comm:
            loss = pmodel.train_step(ids, labels=ids)
        ref_loss = ref(ids, labels=ids).loss
        ref_loss.backward()
        out["loss"] = max(out["loss"], abs(loss.item() - ref_loss.item()))
        for fqn, p in sorted(pmodel.named_parameters()):
            q = ref.get_parameter(fqn)
            out["grad"][fqn] = max(out["grad"].get(fqn, 0.0), _diff(_whole(p.grad), q.grad))
            out["scale"] = max(out["scale"], q.grad.abs().max().item())
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    for fqn, p in sorted(pmodel.named_parameters()):
        out["param"][fqn] = _diff(_whole(p), ref.get_parameter(fqn))
    out["names"] = sorted(n for n, _ in ref.named_parameters())
    out["collectives"] = comm.counts
    out["units"] = sum(isinstance(m, FSDPModule) and bool(m._parameters) for m in _fsdp_modules(pmodel))
    if save is not None:
        dcp.save({"model": pmodel.state_dict(), "optim": get_optimizer_state_dict(pmodel, opt)}, checkpoint_id=save)
        out["saved"] = _full(pmodel)
    return out


def _fsdp_modules(pmodel) -> list:
    """The FSDP modules that run this rank's program(s): its pipeline stages' or its program's units."""
    if pmodel._pipeline is not None:
        return [m for stage in pmodel._pipeline.stages for m in stage.submod.modules()]
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


# ---------------------------------------------------------------- schedules and meshes

CASES = [  # (model, mesh, schedule, options): each schedule on a mesh, both models on each mesh
    ("llama", PIPE, "1F1B", {}),
    ("gpt2", PIPE, "zero-bubble", {}),
    ("llama", PIPE_TENSOR, "interleaved", {"virtual_stages": 2}),
    ("gpt2", PIPE_TENSOR, "gpipe", {}),
    ("llama", PIPE_DATA, "gpipe", {}),
    ("gpt2", PIPE_DATA, "interleaved", {"virtual_stages": 2}),
]


@pytest.mark.parametrize("name,mesh,schedule,options", CASES,
                         ids=[f"{c[0]}-{'x'.join(a for a, _ in c[1])}-{c[2]}" for c in CASES])
def test_pipeline_trains_like_one_device(ranks2, ranks4, name, mesh, schedule, options):
    if "tensor" in dict(mesh):
        options = {**options, "memory_budget": TENSOR_BUDGET[name]}
    if "data" in dict(mesh):
        options = {**options, "data_parallel": "fsdp"}
    plan = _plan(name, mesh, pipeline_schedule=schedule, **options)
    assert Plan.from_json(plan).pipeline.schedule == schedule
    if "tensor" in dict(mesh):
        assert _sharded_on_tensor(Plan.from_json(plan)), "the budget lets every stage keep its weights whole"
    results = (ranks4 if len(mesh) == 2 else ranks2).run(_train, name, mesh, plan, **options)
    _check(results)
    if "data" in dict(mesh):
        _check_fsdp_once(results)
