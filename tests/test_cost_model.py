"""The cost model against the live backend (bytes exact, memory within 15 %) and on its own terms."""

import math

import numpy as np
import pytest
import sympy
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Shard

import autojigsaw
from autojigsaw.cost_model.comm import RING, TREE_ALL_REDUCE, collective_time
from autojigsaw.ir import bytes_sent
from autojigsaw.cost_model.compute import flops, kind_name, op_kind, roofline_time
from autojigsaw.cost_model.devices import device_spec
from autojigsaw.cost_model.formulas import scaling
from autojigsaw.cost_model.memory import saved_for_backward

from .cost_checks import CPU_100US, measure_step, small_model
from .hf_models import batch_of_8

# (model, input shape, mesh, axes, budget): budgets force sharded plans that communicate
CASES = [
    ("mlp", (4, 32, 16), (2,), ("tensor",), 100_000),
    ("mlp", (4, 32, 16), (4,), ("tensor",), 75_000),
    ("mlp", (4, 32, 16), (2, 2), ("domain", "tensor"), 75_000),
    ("stack", (4, 32, 16), (2,), ("tensor",), None),
    ("stack", (4, 32, 16), (2,), ("tensor",), 190_000),
    ("stack", (4, 32, 16), (4,), ("tensor",), 130_000),
    ("stack", (4, 32, 16), (2, 2), ("domain", "tensor"), 100_000),
]


@pytest.mark.parametrize("name,shape,mesh,axes,budget", CASES)
def test_predicted_bytes_and_peak_memory_match_measured(ranks2, ranks4, name, shape, mesh, axes, budget):
    pool = ranks2 if math.prod(mesh) == 2 else ranks4
    results = pool.run(measure_step, small_model, (name, shape), mesh, axes, budget=budget)
    for r in results:
        assert r.sent_bytes == r.predicted_bytes, (r.sent_bytes, r.predicted_bytes)
        assert abs(r.memory_error) <= 0.15, (r.predicted_peak, r.peak)
    if budget is not None:
        assert results[0].sent_bytes > 0  # the plan communicates: the comparison means something


def test_a_gathered_activation_saved_by_its_last_reader_is_counted_once(ranks2):
    """GPT-2's MLP on 100 us links: c_fc splits its output, c_proj gathers it and saves the gathered
    copy for its weight's gradient. The copy was counted twice (as the saved input and as a moved
    copy held to the backward, as for a gathered weight): 13 % over the measured peak; now 0.0 %."""
    for r in ranks2.run(measure_step, batch_of_8, ("gpt2",), (2,), ("tensor",), device=CPU_100US):
        plan = autojigsaw.Plan.from_json(r.plan)
        assert any(n.kind == "matmul" and n.comm_bytes > 0 for n in plan.nodes), plan  # a matmul gathers
        assert abs(r.memory_error) <= 0.02, (r.predicted_peak, r.peak)


def test_a_step_of_accumulated_microbatches_holds_their_gradients_and_the_whole_batch(ranks2):
    """Four microbatches of 2 x 64 rows through the MLP on tensor=2, by train_step: the earlier microbatches'
    gradients live from the step's start, this one's beside them until it is added in, and the batch's other
    slices of the input all step. Counted as in a step of one microbatch the prediction was 16.2 % under the
    measured peak; now it is exact, as a step of one is (test_predicted_bytes_and_peak_memory_match_measured)."""
    for r in ranks2.run(measure_step, small_model, ("mlp", (8, 64, 16)), (2,), ("tensor",), microbatches=4):
        assert abs(r.memory_error) <= 0.01, (r.predicted_peak, r.peak)


_X_SPLIT = {"x": lambda strategy: strategy.outputs[0] == (Shard(0),)}  # the MLP's input split by batch


def _input_items(**options) -> list[tuple[float, int, int]]:
    """(bytes, first point, last point) of the memory items of the MLP's input x (8 x 64 x 16 floats) on tensor=2,
    its batch split; the step's last point is 20."""
    model, inputs = small_model("mlp", (8, 64, 16))
    plan = autojigsaw.plan(model, inputs, {"tensor": 2}, device="cpu", **options)
    assert plan.input_placements == ((Shard(0),),)
    memory, choice = plan.explainer.problem.memory, plan.explainer.solution.choice
    x = plan.explainer.problem.names.index("x")
    return [(it.scale * memory.vectors[it.vec][choice[x]], it.start, it.end) for it in memory.lin if it.node == x]


def test_an_input_is_held_as_the_caller_passes_it():
    """Passed whole (32 KiB), x lives whole all step on every rank and its shard is a view; under bf16 mixed precision
    the caller's fp32 x lives all step and its shard is cast, a copy (8 KiB) from x's point to its last reader;
    passed as this rank's shards (input_placements), the shard (16 KiB) alone. A budget that does not fit says that
    x is held whole and how not to."""
    assert _input_items(constraints=_X_SPLIT) == [(32768, 0, 20)]
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    assert _input_items(constraints=_X_SPLIT, mp_policy=bf16) == [(32768, 0, 20), (8192, 4, 8)]
    assert _input_items(input_placements=[(Shard(0),)]) == [(16384, 4, 8)]
    with pytest.raises(ValueError, match="holds the input x whole, as passed: input_placements= passes each rank"):
        autojigsaw.plan(*small_model("mlp", (8, 64, 16)), {"tensor": 2}, device="cpu", memory_budget=50_000)


def test_a_plan_records_how_its_inputs_are_passed():
    """evaluate prices a plan's inputs as the plan was made for them (it priced them whole), and the JSON keeps it."""
    model, inputs = small_model("mlp", (8, 64, 16))
    for options, whole in (({"constraints": _X_SPLIT}, True), ({"input_placements": [(Shard(0),)]}, False)):
        plan = autojigsaw.plan(model, inputs, {"tensor": 2}, device="cpu", **options)
        again = autojigsaw.Plan.from_json(plan.to_json())
        assert plan.whole_inputs is again.whole_inputs is whole
        assert autojigsaw.evaluate(again, model, inputs, device="cpu").memory_per_rank == plan.memory_per_rank


def test_an_optimizer_step_streams_its_passes_over_each_parameter():
    """A fused or foreach Adam reads the weight, its gradient and two states and writes three (7 passes); Composer's
    DecoupledAdamW, a kernel per op, makes 20; SGD 3. A 16 MiB weight on an H100 streams them at its bandwidth."""
    with torch.device("meta"):
        model, x = torch.nn.Linear(2048, 2048), torch.empty(64, 2048)
    step = {name: next(n.compute_s for n in autojigsaw.plan(model, (x,), {"tensor": 1}, device="h100",
                                                              optimizer=name).nodes if n.name == "p_weight")
            for name in ("adam", "decoupled_adamw", "sgd")}
    assert step["decoupled_adamw"] / step["adam"] == pytest.approx(20 / 7)
    assert step["sgd"] / step["adam"] == pytest.approx(3 / 7)


def test_collective_bytes_and_ring_or_tree_time():
    assert bytes_sent("all_gather", 100, 4) == 300 and bytes_sent("reduce_scatter", 400, 4) == 300
    assert bytes_sent("all_reduce", 400, 4) == 600 and bytes_sent("all_to_all", 400, 4) == 300
    ring = 2 * 7 * 1e-5 + bytes_sent("all_reduce", 10**9, 8) / 1e11
    assert collective_time("all_reduce", 10**9, 8, 1e-5, 1e11) == pytest.approx(ring)  # big: ring
    tree = 2 * 3 * 1e-5 + 2 * 1024 / 1e11
    assert collective_time("all_reduce", 1024, 8, 1e-5, 1e11) == pytest.approx(tree)  # small: tree
    assert collective_time("all_reduce", 1024, 8, 1e-5, 1e11, tree=False) == pytest.approx(
        2 * 7 * 1e-5 + bytes_sent("all_reduce", 1024, 8) / 1e11)
    # the compiled formula is the sympy expression
    value = float(RING["all_gather"].subs({"B": 4096, "n": 4, "alpha": 1e-5, "beta": 1e9}))
    assert RING["all_gather"](4096, 4, 1e-5, 1e9) == pytest.approx(value)
    assert TREE_ALL_REDUCE(np.array([1.0, 2.0]), 4, 1e-5, 1e9).shape == (2,)


def test_flops_per_kind_and_roofline():
    aten = torch.ops.aten
    assert flops(aten.linear.default, [(8, 128, 64), (256, 64)], [(8, 128, 256)]) == 2 * 8 * 128 * 256 * 64
    q = (2, 4, 16, 8)
    assert flops(aten.scaled_dot_product_attention.default, [q, q, q], [q]) == 2 * 8 * 16 * 16 * 16
    assert op_kind(aten._softmax.default).name == "softmax" and op_kind(aten.layer_norm.default).name == "norm"
    # numpy columns: every strategy at once
    m = np.array([128.0, 64.0])
    assert list(flops(aten.mm.default, [(m, 32), (32, 16)], [(m, 16)])) == [2 * 128 * 16 * 32, 2 * 64 * 16 * 32]
    batch = sympy.Symbol("batch", positive=True)
    expr = flops(aten.linear.default, [(batch, 64), (256, 64)], [(batch, 256)])
    assert scaling(expr, {"batch"}) == "batch"


def test_patch_convolutions_cost_their_equivalent_linears():
    """A 1-D patch embedding (stride == kernel) and its transposed recovery are linears on patches."""
    aten = torch.ops.aten
    embed = flops(aten.conv1d.default, [(1, 72, 1200), (32, 72, 60), (32,)], [(1, 32, 20)])
    assert embed == flops(aten.linear.default, [(20, 72 * 60), (32, 72 * 60)], [(20, 32)])
    recover = flops(aten.conv_transpose1d.default, [(1, 64, 20), (64, 69, 60), (69,)], [(1, 69, 1200)])
    assert recover == flops(aten.linear.default, [(20, 64), (69 * 60, 64)], [(20, 69 * 60)])
    assert {op_kind(op).name for op in (aten.conv1d.default, aten.conv3d.default, aten.conv_transpose2d.input)} == {"conv"}


def test_patch_convolutions_run_on_cuda_cores():
    """TF32 and bf16 speed up a sliding convolution, not a patchwise one (cuDNN's weak case)."""
    aten = torch.ops.aten
    patch = (aten.conv1d.default, [(1, 72, 1200), (32, 72, 60)], [(1, 32, 20)])
    recover = (aten.conv_transpose1d.default, [(1, 64, 20), (64, 69, 60)], [(1, 69, 1200)])
    sliding = (aten.conv2d.default, [(8, 64, 32, 32), (64, 64, 3, 3)], [(8, 64, 32, 32)])
    pointwise = (aten.conv2d.default, [(8, 64, 32, 32), (64, 64, 1, 1)], [(8, 64, 32, 32)])
    assert [kind_name(*c) for c in (patch, recover, sliding, pointwise)] == ["patch_conv", "patch_conv", "conv", "conv"]
    fp32, tf32 = device_spec("a100-40gb"), device_spec("a100-40gb+tf32")

    def time(case, dtype, device):
        return roofline_time(1e12, 1e6, dtype, device, kind_name(*case))

    assert time(patch, torch.float32, tf32) == time(patch, torch.float32, fp32)
    assert time(recover, torch.float32, tf32) == time(recover, torch.float32, fp32)
    assert time(sliding, torch.float32, tf32) == pytest.approx(time(sliding, torch.float32, fp32) * 19.5 / 156)
    assert time(patch, torch.bfloat16, fp32) == time(patch, torch.float32, fp32)
    assert time(sliding, torch.bfloat16, fp32) == pytest.approx(time(sliding, torch.float32, fp32) * 19.5 / 312)


def test_what_ops_save_for_backward():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w):
        return torch.softmax(torch.nn.functional.gelu(x @ w), -1)

    gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 8), torch.randn(8, 8))
    nodes = {n.target: n for n in gm.graph.nodes if n.op == "call_function"}
    aten = torch.ops.aten
    assert saved_for_backward(nodes[aten.mm.default]).inputs == {0, 1}
    assert saved_for_backward(nodes[aten.gelu.default]).inputs == {0}
    assert saved_for_backward(nodes[aten._softmax.default]).outputs == {0}
    # a memory format reaches the probe as itself (a string of it made the probe fail: "keeps all")
    expanded = make_fx(lambda x: x.expand(2, 4, 8).clone(memory_format=torch.contiguous_format),
                       tracing_mode="fake")(torch.randn(1, 4, 8))
    clone = next(n for n in expanded.graph.nodes if n.target is aten.clone.default)
    assert saved_for_backward(clone).inputs == set()


def test_attention_saves_its_mask_a_boolean_one_as_a_float_copy():
    graph = torch.fx.Graph()
    q, k, v, mask = (graph.placeholder(name) for name in ("q", "k", "v", "mask"))
    for x in (q, k, v):
        x.meta["val"] = torch.empty(2, 4, 16, 8, device="meta")
    sdpa = graph.call_function(torch.ops.aten.scaled_dot_product_attention.default, (q, k, v, mask))
    mask.meta["val"] = torch.empty(2, 1, 16, 16, dtype=torch.bool, device="meta")
    assert saved_for_backward(sdpa).inputs == {0, 1, 2} and saved_for_backward(sdpa).converted == {3}
    mask.meta["val"] = torch.empty(2, 1, 16, 16, device="meta")
    assert saved_for_backward(sdpa).inputs == {0, 1, 2, 3} and not saved_for_backward(sdpa).converted


def test_explain_prints_formulas_in_model_sizes():
    with torch.device("meta"):
        model, inputs = small_model("mlp", (8, 512, 64), d=64, hidden=256)
        inputs = tuple(x.to("meta") for x in inputs)
    plan = autojigsaw.plan(model, inputs, {"domain": 2, "tensor": 2}, device="h100")
    text = plan.explain("linear")
    assert "matmul FLOPs" in text and "batch" in text and "seq" in text and "domain" in text
    chosen = [line for line in text.splitlines() if line.startswith("*")]
    assert len(chosen) == 1


def test_devices_table_and_alias():
    assert device_spec("cpu") is device_spec("cpu-gloo")
    table = device_spec("h100").table()
    assert "NVLink" in table and "InfiniBand" in table
    spec = device_spec("h100")
    assert spec.axis_link((8, 8), 1).name.startswith("NVLink") and spec.axis_link((8, 8), 0).name.startswith("Infini")
