"""A plan's memory on CUDA as torch's caching allocator holds it (cost_model/allocations.py,
planner/reserved.py): the step's allocations replayed, eager and compiled, FSDP's streams, and the
rule that re-solves a plan whose reserved peak does not fit the budget."""

import logging
from types import SimpleNamespace

import pytest
import torch

import autojigsaw
from autojigsaw.cost_model.allocations import ALL_GATHER, REDUCE_SCATTER, Footprint, lifetimes
from autojigsaw.cost_model.memory import saved_for_backward
from autojigsaw.planner.recompute import Recomputed
from autojigsaw.planner.reserved import allocator_facts, solve_reserved

from .side_by_side import planned

logging.getLogger("transformers").setLevel(logging.ERROR)
BF16 = dict(mp_policy=torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                   reduce_dtype=torch.float32))


def _llama(hidden=64, layers=2, vocab=128, batch=4, seq=64):
    """A Hugging Face Llama on the meta device and its token ids (labels too: it returns its loss and logits)."""
    import transformers as tf

    cfg = tf.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab, use_cache=False)
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)
    return model, torch.zeros(batch, seq, dtype=torch.long, device="meta")


def _planned(device, mesh=None, **kw):
    """autojigsaw.plan of _llama (of `sizes`) on `mesh` (one rank), its graph captured once per size."""
    sizes = kw.pop("sizes", {})

    def make():
        model, ids = _llama(**sizes)
        return model, (ids,), {"labels": ids}
    return planned(("meta llama", tuple(sorted(sizes.items()))), mesh or {"tensor": 1}, make, device=device, **kw)


def _spans(plan, compiled: bool):
    e = plan.explainer
    params = {n.name: n.name for n in plan.nodes if n.kind == "param"}
    facts = allocator_facts(e.nodes, params, e.grad, e.ctx.device, training=plan.training)
    return lifetimes(e.problem.memory, e.solution.choice, facts, compiled=compiled), facts


def test_a_cpu_plan_is_priced_as_bytes_live_and_its_json_is_unchanged():
    plan = _planned("cpu")
    assert plan.memory_allocated is None and "memory_allocated" not in plan.to_json()
    assert plan.memory_per_rank == int(round(plan.explainer.solution.peak_memory))


def test_a_cuda_plan_is_priced_as_the_allocator_reserves():
    plan = _planned("h100")
    live = plan.explainer.solution.peak_memory
    # every block is rounded up to 512 B; this model's requests are all small: packed into 2 MiB segments
    assert live <= plan.memory_allocated < plan.memory_per_rank and plan.memory_per_rank % 2**21 == 0
    assert autojigsaw.Plan.from_json(plan.to_json()).memory_allocated == plan.memory_allocated
    assert "reserved" in plan.summary_line()


def test_eager_backward_of_a_cross_entropy_makes_the_gradient_of_its_log_probabilities():
    """aten.cross_entropy_loss is log_softmax and nll_loss to autograd: nll_loss's backward makes a dense
    gradient of the log-probabilities beside the logits' gradient, which the replay adds (eager and compiled:
    the loss is outside the compiled layers)."""
    plan = _planned("h100", sizes=dict(vocab=4096))
    n = len(plan.explainer.problem.names)
    ce = plan.explainer.problem.names.index(next(x.name for x in plan.nodes if x.op == "aten.cross_entropy_loss"))
    log_probs = 4 * 4 * 64 * 4096  # fp32, batch x seq x vocab
    for compiled in (False, True):
        spans, _ = _spans(plan, compiled)
        at_backward = [t for t in spans if t.start == t.end == 2 * n - 1 - ce]
        assert [t.nbytes for t in at_backward].count(log_probs) == 1, at_backward


class _Chain(torch.nn.Module):
    """Elementwise ops between matmuls: x + fc(sin(x) * cos(sin(x))), in a stack of layers."""

    def __init__(self, width: int):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x):
        s = x.sin()
        return x + self.fc(s * s.cos())


class _Stack(torch.nn.Module):
    def __init__(self, width: int = 512, depth: int = 2):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Chain(width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_cross_entropy_saves_its_log_probabilities_once():
    """log_softmax saves its output and nll_loss saves the same tensor again: one storage, counted once."""
    graph = torch.fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    x.meta["val"] = torch.empty(256, 4096, device="meta")
    y.meta["val"] = torch.zeros(256, dtype=torch.long, device="meta")
    loss = graph.call_function(torch.ops.aten.cross_entropy_loss.default, (x, y))
    loss.meta["val"] = torch.empty((), device="meta")
    saved = saved_for_backward(loss, lambda arg: arg is x)
    assert saved.extra * 4 == 256 * 4096 * 4 + 4  # the log-probabilities and the count of targets (fp32)


def test_a_compiled_layer_allocates_no_output_of_an_elementwise_op_it_fuses():
    """Inference, where a layer's transients make the peak: sin and cos feed only elementwise ops of their
    layer, so a compiled layer never allocates them; the product feeds the matmul and is allocated. Eager
    holds four activations at the product (x, sin, cos, the product), compiled three at the matmul (x, the
    product, its output)."""
    with torch.device("meta"):
        model, x = _Stack(), torch.empty(8, 1024, 512)
    eager = autojigsaw.plan(model, (x,), {"tensor": 1}, device="h100", training=False)
    compiled = autojigsaw.plan(model, (x,), {"tensor": 1}, device="h100+compile", training=False)
    _, facts = _spans(eager, compiled=False)
    assert sorted(eager.explainer.problem.names[i].rstrip("_0123456789") for i in facts.fused) == ["cos", "cos", "sin",
                                                                                                   "sin"]
    activation = 8 * 1024 * 512 * 4
    assert eager.memory_allocated - compiled.memory_allocated == activation


def test_fsdp_gathers_into_buffers_of_its_copy_in_stream_and_reduces_into_its_reduce_scatter_stream():
    plan = _planned("h100", mesh={"data": 2}, data_parallel="fsdp", **BF16)
    spans, facts = _spans(plan, compiled=False)
    trained = sum(1 for n in plan.nodes if n.kind == "param")
    streams = [t.stream for t in spans]
    # one flat buffer per parameter at each of its unit's gathers (forward, backward), a sharded gradient each
    assert streams.count(ALL_GATHER) == 2 * trained and streams.count(REDUCE_SCATTER) == trained
    ddp = _spans(_planned("h100", mesh={"data": 2}, data_parallel="ddp", **BF16), compiled=False)[0]
    assert {t.stream for t in ddp} == {"default"}


def test_the_returned_logits_get_no_gradient_from_the_output_when_the_loss_is_returned():
    """The loss alone is backpropagated: the logits returned beside it get their gradient from the loss's
    nodes (at their backward), not from the output's, the first point of the backward (3.9 GiB too many at
    the torchtitan Llama's peak before)."""
    plan = _planned("cpu", sizes=dict(vocab=1000))
    e = plan.explainer
    names, n = e.problem.names, len(e.problem.names)
    logits = names.index(next(x.name for x in plan.nodes if x.op == "aten.linear" and x.shape[-1] == 1000))
    grads = [it for it in e.problem.memory.lin if it.node == logits and it.start >= n and it.end == 2 * n - 1 - logits]
    assert len(grads) == 1 and grads[0].start > n, (grads, e.problem.memory.describe(grads[0].start))


def test_a_plan_that_fits_as_bytes_live_but_not_as_reserved_is_solved_again_under_the_excess():
    bounds, most_live = [], [80]

    def solve_under(bound):
        bounds.append(bound)
        return Recomputed(None, SimpleNamespace(peak_memory=min(bound, most_live[0])))  # the plan's live peak

    # the first plan lacks 30 B: the second bound (100 - 30) gives a plan that fits
    fitted = solve_reserved(solve_under, 100, lambda c: Footprint(100, 90, 0, 1, 30 if len(bounds) == 1 else 0))
    assert bounds == [100, 70] and fitted.footprint.shortfall == 0 and fitted.chosen.solution is not None
    bounds.clear()
    never = solve_reserved(solve_under, 100, lambda c: Footprint(100, 90, 0, 1, 5))  # 5 B short, every time
    # 100 - 5 would not bind the plan (80 B live): lowered from its peak, then by 10, 20, 40 from the bound
    assert bounds == [100, 75, 65, 45, 5] and never.chosen.solution is None
    bounds.clear()
    most_live[0] = 50  # the plan is 50 B live, far under the budget, and lacks 30 B: 50 - 30, not 100 - 30
    far = solve_reserved(solve_under, 100, lambda c: Footprint(100, 45, 0, 1, 30 if len(bounds) == 1 else 0))
    assert bounds == [100, 20] and far.footprint.shortfall == 0 and far.chosen.solution is not None
    bounds.clear()
    unlimited = solve_reserved(solve_under, 100, lambda c: Footprint(130, 90, 0))  # a replay with no capacity
    assert bounds[:2] == [100, 20] and unlimited.chosen.solution is None
    bounds.clear()
    assert solve_reserved(solve_under, 100, lambda c: None).footprint is None and bounds == [100]  # no allocator


def test_the_planner_keeps_the_reserved_peak_within_the_budget():
    """A budget between the bytes live and the bytes reserved of the plan that a loose budget gives: that
    plan fits the memory rows but not the allocator, so the planner solves again and saves memory."""
    options = dict(mesh={"tensor": 4}, sizes=dict(hidden=512, batch=8, seq=512), activation_checkpointing="auto")
    loose = _planned("h100", **options)
    live, reserved = loose.explainer.solution.peak_memory, loose.memory_per_rank
    assert reserved > 1.05 * live
    budget = int((live + reserved) / 2)
    tight = _planned("h100", memory_budget=budget, **options)
    assert tight.memory_per_rank <= budget < loose.memory_per_rank
    assert tight.explainer.solution.peak_memory < live


def test_no_plan_that_fits_the_allocator_is_an_error_that_says_so():
    loose = _planned("h100", sizes=dict(hidden=256))
    with pytest.raises(ValueError, match="as torch's CUDA caching allocator holds memory"):
        _planned("h100", sizes=dict(hidden=256), memory_budget=int(loose.explainer.solution.peak_memory * 1.001))
