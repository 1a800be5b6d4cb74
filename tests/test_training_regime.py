"""The runs people launch: mixed precision, recomputation and FSDP, planned and run, against one device.

Recomputation is a planner decision (none / selective / full / auto per layer) and a runtime
one (checkpointed layers): gradients equal those without it, and the measured peak memory
(MemTracker) drops as the plan predicts. Mixed precision keeps fp32 masters (the DTensors the
optimizer sees) and computes in bf16. FSDP on a data axis is priced (sharded states, gathers).
"""

import copy
import functools
import warnings
from dataclasses import replace

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Partial, Shard

import autojigsaw
from autojigsaw import Plan
from autojigsaw.cost_model.devices import device_spec
from autojigsaw.cost_model.liveness import ParamMemory
from autojigsaw.cost_model.memory import saved_for_backward
from autojigsaw.planner import solve
from autojigsaw.planner.milp import SolverTimeout
from autojigsaw.rewrite.recompute import Checkpointed
from autojigsaw.testing.local_ranks import get_mesh

from .cost_checks import CPU_100US, measure_step
from .hf_models import batch_of_8
from .side_by_side import build, loss_of, planned

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _llama(batch: int = 8, seq: int = 64, attention: str = "sdpa"):
    """The tiny Hugging Face Llama on a batch whose activations outweigh its weights (`attention`: transformers'
    attn_implementation, "sdpa" or "eager": matmul, softmax, matmul)."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, use_cache=False, attn_implementation=attention)
    ids = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(1))
    return tf.LlamaForCausalLM(cfg), (ids,)


def _plan(policy: str, device="cpu", attention: str = "sdpa", mesh=None, **kw) -> Plan:
    """autojigsaw.plan of _llama on `mesh` (tensor=2) under recomputation `policy` (its graph captured once)."""
    return planned(("llama 8x64", (("attention", attention),)), mesh or {"tensor": 2},
                   functools.partial(_llama, attention=attention), device=device, activation_checkpointing=policy, **kw)


# ---------------------------------------------------------------- bad input


def test_an_unknown_recomputation_policy_lists_the_choices():
    with pytest.raises(ValueError, match=r"activation_checkpointing='some'.*"
                                         r"'auto', 'none', 'selective', 'selective-op', 'full'"):
        _plan("some")


def test_fsdp_without_a_data_axis_names_the_mesh_axes():
    model, inputs = _llama()
    with pytest.raises(ValueError, match=r"data_parallel='fsdp' needs a mesh axis named.*\('domain', 'tensor'\)"):
        autojigsaw.plan(model, inputs, {"domain": 2, "tensor": 2}, device="cpu", data_parallel="fsdp")


def test_an_unknown_data_parallel_lists_the_choices():
    # the value is wrong, not the mesh: it was blamed on the mesh's axes
    model, inputs = _llama()
    with pytest.raises(ValueError, match=r"data_parallel='zero3': choose one of \('fsdp', 'ddp'\)"):
        autojigsaw.plan(model, inputs, {"tensor": 2}, device="cpu", data_parallel="zero3")


def test_a_compute_dtype_the_device_lacks_is_refused():
    model, inputs = _llama()
    with pytest.raises(ValueError, match=r"param_dtype=torch.float16 cannot be computed in on device 'cpu-gloo'"):
        autojigsaw.plan(model, inputs, {"tensor": 2}, device="cpu",
                        mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))


def test_recomputation_asked_of_a_model_without_repeated_layers_says_so():
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    with pytest.raises(ValueError, match=r"activation_checkpointing='full': recomputation runs per repeated layer"
                                         r".*has none.*named nn.ModuleList.*activation_checkpointing='none'"):
        autojigsaw.plan(mlp, (torch.randn(4, 16),), {"tensor": 2}, device="cpu", activation_checkpointing="full")
    assert autojigsaw.plan(mlp, (torch.randn(4, 16),), {"tensor": 2}, device="cpu",
                           activation_checkpointing="auto").recompute == ()


def test_selective_op_says_when_a_layer_runs_other_products_than_planned():
    """torchtitan's policy counts the products a layer dispatches; where a kernel runs another number
    than the plan counted, other ones are recomputed than were priced: said, once; gradients stay exact."""
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    want = torch.autograd.grad(layer(x).sum(), [x, *layer.parameters()])
    as_planned, miscounted = (Checkpointed(layer, "selective-op", n, "model.layers.0") for n in (3, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = torch.autograd.grad(as_planned(x).sum(), [x, *layer.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.warns(UserWarning, match=r"model.layers.0 ran 3 matrix products \(aten.mm/addmm\) where the plan "
                                         r"counted 2"):
        miscounted(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        miscounted(x)


def test_no_plan_even_with_recomputation_says_so():
    with pytest.raises(ValueError, match=r"Recomputation was tried \(activation_checkpointing='auto'\)"):
        _plan("auto", memory_budget=10_000)


# ---------------------------------------------------------------- planning


def _recomputed(plan: Plan, policy: str, attention: str = "sdpa") -> Plan:
    """The same sharding with every layer recomputed under `policy`, priced."""
    layers = (("model.layers.0", policy), ("model.layers.1", policy)) if policy != "none" else ()
    model, inputs = _llama(attention=attention)
    return autojigsaw.evaluate(replace(plan, recompute=layers), model, inputs, device="cpu")


def test_recomputation_trades_memory_for_time():
    assert _plan("none").recompute == ()
    assert _plan("selective").recompute_summary() == "selective on model.layers.{0..1} (x2)"
    assert _plan("selective-op").recompute_summary() == "selective-op on model.layers.{0..1} (x2)"
    plans = {p: _recomputed(_plan("none"), p) for p in ("none", "selective", "selective-op", "full")}
    mem = {p: plan.memory_per_rank for p, plan in plans.items()}
    step = {p: plan.step_time for p, plan in plans.items()}
    assert mem["full"] < mem["selective-op"] < mem["selective"] < mem["none"], mem
    assert step["none"] < step["selective"] < step["selective-op"] < step["full"], step


def test_auto_recomputes_only_when_the_budget_asks():
    """Loose: nothing recomputed. Tighter than any sharding alone: the fewest layers, selective
    before full; tighter still: full. Always at least as fast as recomputing everything fully.
    Links of 100 us: at 0.55 of the loose plan's memory no sharding alone fits."""
    plan = functools.partial(_plan, device=CPU_100US)
    none = plan("none")
    assert plan("auto").recompute == ()
    budget = int(0.55 * none.memory_per_rank)
    with pytest.raises(ValueError, match="no plan fits"):
        plan("none", memory_budget=budget)
    some = plan("auto", memory_budget=budget)
    assert some.recompute == (("model.layers.0", "selective"),) and some.memory_per_rank <= budget
    assert some.step_time <= plan("full", memory_budget=budget).step_time
    tight = plan("auto", memory_budget=int(0.45 * none.memory_per_rank))
    assert {policy for _, policy in tight.recompute} == {"full"}


def test_once_no_recomputation_fits_the_other_variants_are_searched_only_for_a_faster_plan():
    """'auto' solves each recomputed variant with beat= the time of the plan without recomputation:
    here each has a plan of its own, slower, and is ruled out; the plan is the one without."""
    calls = []

    def recorded(problem, budget, **kw):
        calls.append((problem, budget, kw.get("beat"), solve(problem, budget, **kw)))
        return calls[-1][-1]

    plan = _plan("auto", solver=recorded)
    (_, _, no_beat, none), *variants = calls
    assert no_beat is None and none is not None and len(variants) == 2
    for problem, budget, beat, solution in variants:
        assert beat == none.objective and solution is None
        assert solve(problem, budget, mip_gap=0).objective > beat
    assert plan.recompute == () and plan.fingerprint() == _plan("none").fingerprint()


def test_a_recomputation_variant_out_of_time_keeps_the_others_plans():
    """'auto' solves several variants; one that hits the time limit warns and counts as not
    fitting, instead of failing the plan. If every variant runs out, the time limit is the error."""
    calls, none = [], _plan("none")

    def slow_after(n: int):
        def slow(problem, budget, **kw):
            calls.append(problem)
            if len(calls) > n:
                raise SolverTimeout("the planner found no plan within its time limit of 1 s")
            return solve(problem, budget, **kw)
        return slow

    with pytest.warns(UserWarning, match=r"ran out of time on 2 layers selective, 2 layers full"):
        plan = _plan("auto", solver=slow_after(1))
    assert plan.recompute == () and plan.fingerprint() == none.fingerprint()
    calls.clear()
    with pytest.raises(SolverTimeout, match="time limit"):
        _plan("auto", solver=slow_after(0))


def test_a_product_with_a_constant_saves_only_the_constant():
    """q * cos keeps cos for q's gradient; q too only when cos needs a gradient (the rotary embedding)."""
    graph = torch.fx.Graph()
    q, cos = graph.placeholder("q"), graph.placeholder("cos")
    q.meta["val"], cos.meta["val"] = torch.empty(4, 8, device="meta"), torch.empty(8, device="meta")
    mul = graph.call_function(torch.ops.aten.mul.Tensor, (q, cos))
    assert saved_for_backward(mul, lambda arg: arg is q).inputs == {1}
    assert saved_for_backward(mul).inputs == {0, 1}


def test_mixed_precision_keeps_fp32_masters_and_bf16_activations():
    assert ParamMemory.of(2, mixed=True, fsdp_ranks=1) == ParamMemory(3.0, 2.0, 2.0, False)
    assert ParamMemory.of(2, mixed=True, fsdp_ranks=8) == ParamMemory(0.25, 0.25, 0.25, True, 1.0)
    assert ParamMemory.of(2, mixed=True, fsdp_ranks=8, reduce_itemsize=4).scatter == 2.0  # fp32 sums of bf16
    assert ParamMemory.of(4, mixed=False, fsdp_ranks=1) == ParamMemory()
    fp32, mixed = _plan("none"), _plan("none", mp_policy=BF16)
    assert mixed.precision == "bf16 compute, fp32 masters, fp32 gradient sums"
    assert mixed.memory_per_rank < fp32.memory_per_rank  # activations halve; weights do not shrink


def test_fsdp_shards_the_weights_state_over_the_data_axis():
    ddp = _plan("none", mesh={"data": 2, "tensor": 2}, data_parallel="ddp")
    fsdp = _plan("none", mesh={"data": 2, "tensor": 2})
    assert (ddp.data_parallel, fsdp.data_parallel) == ("ddp", "fsdp")
    assert fsdp.memory_per_rank < ddp.memory_per_rank
    assert fsdp.comm_bytes > ddp.comm_bytes  # gathers twice, reduce-scatters once, on top


def test_the_fsdp_traffic_a_step_hides_slows_the_compute_beside_it():
    """Compute that hides FSDP's gathers and reductions runs slower beside them (the GPUs' overlap_slowdown,
    18.9 % by arXiv 2507.03114): the step grows by that share of the hidden traffic, in proportion."""
    model, inputs = _llama(batch=64, seq=256)
    steps = [autojigsaw.plan(model, inputs, {"data": 8}, device=replace(device_spec("h100"), overlap_slowdown=x),
                             mp_policy=BF16).step_time for x in (0.0, 0.2, 0.4)]
    assert steps[0] < steps[1] < steps[2]
    assert steps[2] - steps[0] == pytest.approx(2 * (steps[1] - steps[0]), rel=1e-9)
    assert device_spec("h100").overlap_slowdown == device_spec("a100").overlap_slowdown > 0


# ---------------------------------------------------------------- running


def _recompute_run(plan_json: str, attention: str = "sdpa") -> dict:
    ref, inputs = _llama(attention=attention)
    pmodel = autojigsaw.parallelize(copy.deepcopy(ref), get_mesh((2,), ("tensor",)), inputs, compile=False,
                                    plan=Plan.from_json(plan_json))
    opt = torch.optim.Adam(pmodel.parameters(), lr=1e-3)
    tracker = MemTracker()
    tracker.track_external(pmodel, opt)
    with tracker:
        loss_of(pmodel(*inputs)).backward()
    opt.step()
    peak = int(next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"])
    loss_of(ref(*inputs)).backward()
    scale = max(q.grad.abs().max().item() for q in ref.parameters())
    err = max((p.grad.full_tensor() - q.grad).abs().max().item() for p, q in zip(pmodel.parameters(), ref.parameters()))
    return {"grad": err / scale, "peak": peak}


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_recomputed_layers_give_the_same_gradients_and_free_the_predicted_memory(ranks2, attention):
    # On the "cpu" spec the plan keeps the layers whole, so the peak under "selective" falls in a
    # recomputed layer's backward: the model must know what torch's selective checkpoint keeps
    # there (the cached matmul outputs, the float copy of the boolean attention mask; docs/benchmarks.md
    # checks the same on eight models). "selective-op" (torchtitan's policy: k, o and up
    # projections recomputed too) frees more than "selective" and less than "full". Eager attention
    # (matmul, softmax, matmul) makes its matmuls' contiguous copies of transposed operands and saves
    # them: under "selective" they are recomputed, not kept with the matmul's output, and nothing
    # saved is held during a checkpointed layer's forward.
    base = _plan("none", attention=attention)
    measured, predicted = {}, {}
    for policy in ("none", "selective", "selective-op", "full"):
        plan = _recomputed(base, policy, attention)
        for r in ranks2.run(_recompute_run, plan.to_json(), attention):
            assert r["grad"] <= 64 * 2.0**-24, (policy, r)
        measured[policy], predicted[policy] = r["peak"], plan.memory_per_rank
    assert measured["none"] > measured["selective"] > measured["selective-op"] > measured["full"], measured
    for policy in ("selective", "selective-op", "full"):
        drop, want = measured["none"] - measured[policy], predicted["none"] - predicted[policy]
        assert abs(drop - want) <= 0.15 * want, (policy, measured, predicted)


class _ConvBlock(torch.nn.Module):
    """A residual block of two 3x3 convolutions (a ResNet's, without its norms)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return x + self.conv2(torch.nn.functional.gelu(self.conv1(x)))


class _ConvStack(torch.nn.Module):
    def __init__(self, channels: int = 16, depth: int = 2):
        super().__init__()
        self.layers = torch.nn.ModuleList(_ConvBlock(channels) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _conv_stack():
    torch.manual_seed(0)
    return _ConvStack(), (torch.randn(8, 16, 32, 32, generator=torch.Generator().manual_seed(1)),)


def _conv_recompute_run(plan_json: str) -> dict:
    ref, inputs = _conv_stack()
    pmodel = autojigsaw.parallelize(copy.deepcopy(ref), get_mesh((2,), ("tensor",)), inputs, compile=False,
                                    plan=Plan.from_json(plan_json))
    opt = torch.optim.Adam(pmodel.parameters(), lr=1e-3)
    pmodel(*inputs).square().mean().backward()
    ref(*inputs).square().mean().backward()
    scale = max(q.grad.abs().max().item() for q in ref.parameters())
    err = max((p.grad.full_tensor() - q.grad).abs().max().item() for p, q in zip(pmodel.parameters(), ref.parameters()))
    opt.step()
    opt.zero_grad(set_to_none=True)
    tracker = MemTracker()  # the second step, with the optimizer's states, as the plan prices it
    tracker.track_external(pmodel, opt)
    with tracker:
        pmodel(*inputs).square().mean().backward()
        opt.step()
    return {"grad": err / scale, "peak": int(next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"])}


def test_selective_recomputation_of_convolutions_and_collectives_takes_the_predicted_memory(ranks2):
    """torch's selective checkpoint (the runtime's) recomputes convolutions, as torchtitan's save list,
    and caches a collective's output until the layer's backward even where no reader saves it: the
    plan's first block splits its channels, so its second convolution's partial sums are all-reduced
    inside the layer. Before, the plan predicted that selective recomputation added memory here
    (-262 KiB: convolutions kept) where it freed 1 MiB. The recomputed peaks are within 0.2 %. (Without
    recomputation the peak is this test's loss' backward, outside the model: square().mean() of the
    output makes 2 MiB of temporaries where the plan prices two copies of the output; 9.8 % under.)"""
    model, inputs = _conv_stack()
    base = autojigsaw.plan(model, inputs, {"tensor": 2}, device="cpu")
    assert any(n.outputs == ((Partial(),),) for n in base.nodes if n.module == "layers.0.conv2"), base
    measured, predicted = {}, {}
    for policy in ("none", "selective", "full"):
        layers = (("layers.0", policy), ("layers.1", policy)) if policy != "none" else ()
        plan = autojigsaw.evaluate(replace(base, recompute=layers), model, inputs, device="cpu")
        for r in ranks2.run(_conv_recompute_run, plan.to_json()):
            assert r["grad"] <= 64 * 2.0**-24, (policy, r)
        measured[policy], predicted[policy] = r["peak"], plan.memory_per_rank
    assert measured["none"] > measured["selective"] > measured["full"], measured
    for policy in ("selective", "full"):
        assert abs(predicted[policy] - measured[policy]) <= 0.05 * measured[policy], (policy, measured, predicted)


def test_a_residual_gradient_is_held_from_its_first_contribution(ranks2):
    """A residual block's input is read by its first convolution and by the residual add; in the
    backward autograd holds its gradient from the add's contribution, through the whole block, to
    the convolution's. The memory model counted it from the last contribution: ConvNeXt V2 with
    every stage recomputed peaks in a stage's backward, and was predicted 13.8 % under; now 1.5 %."""
    model, inputs = batch_of_8("convnextv2")
    planned = autojigsaw.plan(model, inputs, {"tensor": 2}, device=CPU_100US, activation_checkpointing="full")
    assert {policy for _, policy in planned.recompute} == {"full"} and len(planned.recompute) == 2, planned.recompute
    for r in ranks2.run(measure_step, batch_of_8, ("convnextv2",), (2,), ("tensor",), plan=planned.to_json(),
                        device=CPU_100US):
        assert abs(r.memory_error) <= 0.05, (r.predicted_peak, r.peak)


def _batch_split(strategy) -> bool:
    return strategy.outputs[0] == (Shard(0),)


def test_an_input_passed_whole_is_held_whole_by_every_rank(ranks2):
    """The caller passes each input whole and each rank reads its shard of it, a view: the whole input lives all
    step. The memory model counted the shard: ConvNeXt V2 with its batch of images split over the tensor axis and
    every stage recomputed peaks in a stage's backward, predicted 6.2 % under; now 1.9 %."""
    model, inputs = batch_of_8("convnextv2")
    free = autojigsaw.plan(model, inputs, {"tensor": 2}, device=CPU_100US, activation_checkpointing="full")
    batch_split = {n.name: _batch_split for n in free.nodes
                   if n.module.startswith(("convnextv2.embeddings", "convnextv2.encoder")) and n.kind != "param"}
    split = autojigsaw.plan(model, inputs, {"tensor": 2}, device=CPU_100US, activation_checkpointing="full",
                            constraints=batch_split)
    assert split.input_placements == ((Shard(0),),) and len(split.recompute) == 2, split
    for r in ranks2.run(measure_step, batch_of_8, ("convnextv2",), (2,), ("tensor",), plan=split.to_json(),
                        device=CPU_100US):
        assert abs(r.memory_error) <= 0.05, (r.predicted_peak, r.peak)


def _bf16_run(plan_json: str) -> dict:
    ref, inputs = build("mixer", dtype=torch.float32)
    pmodel = autojigsaw.parallelize(copy.deepcopy(ref), get_mesh((2,), ("tensor",)), inputs, compile=False,
                                    plan=Plan.from_json(plan_json), mp_policy=BF16)
    low = copy.deepcopy(ref).to(torch.bfloat16)  # the single device with the same casts
    loss_of(pmodel(*inputs)).backward()
    loss_of(low(inputs[0].to(torch.bfloat16))).backward()
    scale = max(q.grad.abs().max().item() for q in low.parameters())
    return {"masters": {p.dtype for p in pmodel.parameters()}, "grads": {p.grad.dtype for p in pmodel.parameters()},
            "grad": max((p.grad.full_tensor() - q.grad.float()).abs().max().item()
                        for p, q in zip(pmodel.parameters(), low.parameters())) / scale}


def test_bf16_mixed_precision_matches_the_single_device_with_the_same_casts(ranks2):
    model, inputs = build("mixer", dtype=torch.float32)
    whole = autojigsaw.plan(model, inputs, {"tensor": 1}, device="cpu", mp_policy=BF16).memory_per_rank
    plan = autojigsaw.plan(model, inputs, {"tensor": 2}, device="cpu", mp_policy=BF16, memory_budget=int(0.55 * whole))
    assert any(n.kind == "matmul" and any(not p.is_replicate() for p in n.inputs[1]) for n in plan.nodes)
    for r in ranks2.run(_bf16_run, plan.to_json()):
        assert r["masters"] == {torch.float32} and r["grads"] == {torch.float32}, r
        assert r["grad"] <= 9 * 2.0**-8, r  # one bf16 rounding more per matmul than the single device


def _autocast_run() -> list[str]:
    ref, inputs = build("mixer", dtype=torch.float32)
    pmodel = autojigsaw.parallelize(copy.deepcopy(ref), get_mesh((2,), ("tensor",)), inputs, compile=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pmodel(*inputs)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pmodel(*inputs)
    return [str(w.message) for w in caught if "autocast" in str(w.message)]


def test_a_call_under_autocast_says_the_plan_did_not_price_it(ranks2):
    # autocast applies to the graph's ops as they run, unplanned: partial sums rounded per rank
    for messages in ranks2.run(_autocast_run):
        assert len(messages) == 1 and "pass mp_policy=MixedPrecisionPolicy(" in messages[0], messages
