"""AUTOJIGSAW_CHECK_RANKS=1: planning rewrites and lints the graph of every rank whose graph can differ."""

import pytest
import torch

import autojigsaw
from autojigsaw.mesh import MeshSpec
from autojigsaw.rewrite import every_rank

from .models import MLP

X = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))
REWRITE = every_rank.rewrite  # the real one, which the broken one calls


def test_the_coordinates_checked_are_each_axis_first_two_and_last_two():
    assert every_rank.distinct_coordinates(MeshSpec.of({"tensor": 2})) == [(0,), (1,)]
    assert every_rank.distinct_coordinates(MeshSpec.of({"domain": 6})) == [(0,), (1,), (4,), (5,)]
    assert len(every_rank.distinct_coordinates(MeshSpec.of({"data": 3, "tensor": 8}))) == 3 * 4


def _breaking_on(coord: tuple[int, ...], seen: list):
    """rewrite, whose graph for `coord` reads a value before making it (as a bucketing bug once did)."""
    def broken(captured, plan, rank, **kw):
        gm = REWRITE(captured, plan, rank, **kw)
        seen.append(rank.coord)
        if rank.coord == coord:
            reader = next(n for n in gm.graph.nodes if n.op == "call_function" and n.all_input_nodes
                          and n.all_input_nodes[0].op == "call_function")
            reader.append(reader.all_input_nodes[0])  # the value now comes after its reader
        return gm
    return broken


def test_a_rank_whose_graph_is_broken_fails_the_plan_and_is_named(monkeypatch):
    seen = []
    monkeypatch.delenv(every_rank.CHECK_ENV, raising=False)
    monkeypatch.setattr(every_rank, "rewrite", _breaking_on((1,), seen))
    autojigsaw.plan(MLP(), (X,), {"tensor": 2}, device="cpu")  # not asked for: rank 0's graph only
    assert seen == []
    monkeypatch.setenv(every_rank.CHECK_ENV, "1")
    with pytest.raises(RuntimeError, match=r"the plan's graph for the rank at tensor=1 is broken: .*"
                                           r"used before it has been defined"):
        autojigsaw.plan(MLP(), (X,), {"tensor": 2}, device="cpu")
    assert seen == [(0,), (1,)]
