"""Lowering a traced program once: a process keeps the lowerings it made (and gives them to the ranks it runs),
ranks that traced the same program read rank 0's, and either is the graph a fresh lowering gives, node for
node, and plans alike."""

import torch
from torch.export import ExportedProgram

import autojigsaw
from autojigsaw.capture import capture
from autojigsaw.capture.lowering import forget
from autojigsaw.capture.portable import dumps, fingerprint, loads
from autojigsaw.testing.local_ranks import get_mesh

from .hf_models import hf_model
from .models import ConstantScale, build, compare_training


def _lowerings(run):
    """(run(), how many times it ran torch's run_decompositions)."""
    calls, original = [], ExportedProgram.run_decompositions

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    ExportedProgram.run_decompositions = counted
    try:
        return run(), len(calls)
    finally:
        ExportedProgram.run_decompositions = original


def _described(value):
    """A fake value as what it describes (shape, stride, offset, dtype, device, requires_grad)."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.stride(), value.storage_offset(), value.dtype, value.device,
                value.requires_grad)
    return repr(value)


def _nodes(gm) -> list:
    """Every node's name, target, arguments and metadata (fake values as what they describe)."""
    return [(n.name, str(n.target), repr(n.args), repr(n.kwargs),
             {k: torch.utils._pytree.tree_map(_described, v) if k == "val" else repr(v)
              for k, v in n.meta.items() if k not in ("from_node", "seq_nr")})
            for n in gm.graph.nodes]


def test_a_lowering_read_back_is_the_graph_node_for_node():
    sequential = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    # rotary tables, tied embeddings, an input named as a builtin (nn.Sequential's `input`)
    for model, inputs in (hf_model("llama"), hf_model("gpt2"), (sequential, (torch.randn(2, 16),))):
        ep = torch.export.export(model, inputs, strict=False)
        low = ep.run_decompositions({})
        again = torch.export.export(model, inputs, strict=False)
        assert fingerprint(again) == fingerprint(ep) is not None
        back = loads(dumps(low), again)
        assert back.graph_module.code == low.graph_module.code
        assert _nodes(back.graph_module) == _nodes(low.graph_module)
        assert back.graph_signature == low.graph_signature
        assert back.call_spec.in_spec == low.call_spec.in_spec and back.call_spec.out_spec == low.call_spec.out_spec


def test_a_kept_lowering_plans_alike_and_takes_this_models_constants():
    forget()
    model, inputs = hf_model("llama")
    first, lowered_first = _lowerings(lambda: autojigsaw.plan(model, inputs, {"tensor": 2}, device="cpu",
                                                              memory_budget=3_000_000))
    second, lowered_second = _lowerings(lambda: autojigsaw.plan(model, inputs, {"tensor": 2}, device="cpu",
                                                                memory_budget=3_000_000))
    assert (lowered_first, lowered_second) == (1, 0)
    assert second.to_json() == first.to_json()

    class Scaled(torch.nn.Module):
        def __init__(self, scale: float):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)
            self.scale = torch.full((8,), scale)  # a plain tensor attribute: a lifted constant

        def forward(self, x):
            return self.linear(x) * self.scale

    x = torch.randn(2, 8)
    one, lowered_one = _lowerings(lambda: capture(Scaled(1.0), (x,)))
    two, lowered_two = _lowerings(lambda: capture(Scaled(2.0), (x,)))
    assert (lowered_one, lowered_two) == (1, 0)
    assert two.gm.code == one.gm.code
    assert [c.tolist() for c in two.constants.values()] == [[2.0] * 8]


def test_symbolic_sizes_are_not_portable_and_are_lowered_each_time():
    model, inputs = hf_model("gpt2")
    dims = {"input_ids": {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}}
    ep = torch.export.export(model, (), {"input_ids": inputs[0]}, strict=False, dynamic_shapes=dims)
    assert fingerprint(ep) is None
    _, lowered = _lowerings(lambda: [capture(model, inputs, dynamic=True) for _ in range(2)])
    assert lowered == 2


def _trained_twice():
    """(the max differences from one device of an MLP trained on tensor=2, twice; this rank's lowerings)."""
    forget()
    return _lowerings(lambda: [compare_training("mlp", (4, 8, 16), (2,), ("tensor",), budget=60_000,
                                                model_kwargs={"hidden": 48}) for _ in range(2)])


def _trained_once():
    """(the max differences from one device of an MLP trained on tensor=2; this rank's lowerings)."""
    return _lowerings(lambda: compare_training("mlp", (4, 8, 16), (2,), ("tensor",), budget=60_000,
                                               model_kwargs={"hidden": 40}))


def _scaled_by_rank():
    """(parallelize's error where each rank scales by its own constant; this rank's lowerings)."""
    forget()
    model = ConstantScale(1.0 + torch.distributed.get_rank())

    def refused():
        try:
            autojigsaw.parallelize(model, get_mesh((2,), ("tensor",)), (torch.randn(4, 8, 16, dtype=torch.float64),),
                                   compile=False)
        except ValueError as e:
            return str(e)
        return "not refused"

    return _lowerings(refused)


def test_ranks_that_traced_the_same_program_lower_it_once(ranks2):
    """Rank 0 lowers, rank 1 reads its lowering, and both train as one device; the second parallelize
    lowers nowhere (each process keeps what it lowered or read)."""
    (diffs0, lowered0), (diffs1, lowered1) = ranks2.run(_trained_twice, timeout=300)
    assert (lowered0, lowered1) == (1, 0)
    for diffs in diffs0 + diffs1:
        assert max(diffs[key] for key in ("output", "grad", "param")) <= 1e-10, diffs
    plan = autojigsaw.Plan.from_json(diffs0[0]["plan"])
    assert any(not p.is_replicate() for pl in plan.param_placements.values() for p in pl), plan.table()


def test_ranks_do_not_lower_again_what_the_process_that_runs_them_lowered(ranks2):
    """A LocalRanks task carries the lowerings its process made: a model planned here is not lowered on the
    ranks that parallelize it."""
    x = torch.randn(4, 8, 16, dtype=torch.float64)
    autojigsaw.plan(build("mlp", torch.float64, hidden=40), (x,), {"tensor": 2}, device="cpu")
    (diffs0, lowered0), (diffs1, lowered1) = ranks2.run(_trained_once, timeout=300)
    assert (lowered0, lowered1) == (0, 0)
    for diffs in (diffs0, diffs1):
        assert max(diffs[key] for key in ("output", "grad", "param")) <= 1e-10, diffs


def test_ranks_that_traced_different_programs_each_lower_their_own(ranks2):
    """A fingerprint that differs by rank: no rank's lowering stands for another's, and the agreement check
    still names the program."""
    (message0, lowered0), (message1, lowered1) = ranks2.run(_scaled_by_rank, timeout=300)
    assert (lowered0, lowered1) == (1, 1)
    for message in (message0, message1):
        assert "ranks disagree on the program" in message, message
