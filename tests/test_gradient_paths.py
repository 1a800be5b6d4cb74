"""Gradients go where they go on one device: to inputs, not through no_grad blocks, not twice.

nn.Sequential's forward names its input `input`, a Python builtin, which FX renames in a new graph
("input_1"): a rewrite that lost track of it would give the input's gradient as each rank's partial
sum (14 % off, different on each rank) with no error. A `with torch.no_grad():` block in the
forward (an EMA teacher) must keep its mode through export's decompositions: its weights get no
gradients. Autojigsaw's kernels are differentiable once: with create_graph=True the second
derivatives would miss their collectives, so it is an error.
"""

import copy
import re

import pytest
import torch

import autojigsaw
from autojigsaw.testing.local_ranks import get_mesh

from .side_by_side import whole

F64 = torch.float64
ROUNDOFF = 32 * torch.finfo(F64).eps  # values of order 1; a sharded sum rounds in another order


class _Named(torch.nn.Module):
    """Two inputs named like builtins, both differentiated."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))

    def forward(self, input, format):
        return self.body(input) * format


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "sequential":
        return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                   torch.nn.Tanh(), torch.nn.Linear(64, 4)).to(F64)
    return _Named().to(F64)


def _inputs(kind: str) -> tuple:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 16, dtype=F64, generator=gen)
    return (x,) if kind == "sequential" else (x, torch.randn(8, 16, dtype=F64, generator=gen))


def _sharded(ref: torch.nn.Module, inputs: tuple) -> torch.nn.Module:
    """The parallel copy of `ref` on tensor=2 under 0.6 of its one-rank memory (weights split)."""
    one_rank = autojigsaw.plan(copy.deepcopy(ref), inputs, {"tensor": 1}, device="cpu").memory_per_rank
    pmodel = autojigsaw.parallelize(copy.deepcopy(ref), get_mesh((2,), ("tensor",)), inputs, compile=False,
                                    device="cpu", memory_budget=int(0.6 * one_rank))
    assert any(not p.placements[0].is_replicate() for p in pmodel.parameters()), pmodel.plan.table()
    return pmodel


def _input_gradients(kind: str) -> float:
    """Largest difference from one device of the inputs' gradients and the parameters' ones."""
    ref, inputs = _model(kind), _inputs(kind)
    pmodel = _sharded(ref, inputs)
    grads = []
    for model in (pmodel, ref):
        leaves = [x.clone().requires_grad_() for x in inputs]
        model(*leaves).sin().sum().backward()
        grads.append([x.grad for x in leaves] + [whole(p.grad) for p in model.parameters()])
    return max((a - b).abs().max().item() for a, b in zip(*grads))


@pytest.mark.parametrize("kind", ["sequential", "builtin names"])
def test_input_gradients_match_one_device(ranks2, kind):
    for diff in ranks2.run(_input_gradients, kind):
        assert diff <= ROUNDOFF, diff


def _gradient_penalty() -> str:
    ref, (x,) = _model("sequential"), _inputs("sequential")
    pmodel = _sharded(ref, (x,))
    x = x.clone().requires_grad_()
    try:  # refused at the first backward, the one that builds a graph
        (gx,) = torch.autograd.grad(pmodel(x).sum(), x, create_graph=True)
        gx.square().sum().backward()
    except ValueError as e:
        return str(e)
    return ""


def test_a_gradient_of_a_gradient_is_refused(ranks2):
    """It returned parameter gradients 99 % off, with no error."""
    for error in ranks2.run(_gradient_penalty):
        assert re.search(r"\w+ on mesh axis 'tensor' is differentiable once, and this backward runs with "
                         r"create_graph=True", error), error
        assert "compute that term on the single-device model" in error, error


class _Teacher(torch.nn.Module):
    """A student regressed on a teacher run under no_grad, as self-distillation and BYOL write it."""

    def __init__(self):
        super().__init__()
        self.student = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))
        self.teacher = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))

    def forward(self, x):
        with torch.no_grad():
            target = self.teacher(x)
        return (self.student(x) - target).square().mean()


def _no_grad_block() -> tuple[list, float]:
    """The parameters with a gradient, and the largest difference from one device of the student's and the
    input's gradients."""
    torch.manual_seed(0)
    ref, x = _Teacher().to(F64), _inputs("sequential")[0]
    pmodel = _sharded(ref, (x,))
    grads = []
    for model in (pmodel, ref):
        leaf = x.clone().requires_grad_()
        model(leaf).backward()
        grads.append([leaf.grad] + [whole(p.grad) for n, p in model.named_parameters() if n.startswith("student")])
    with_grad = [n for n, p in pmodel.named_parameters() if p.grad is not None]
    return with_grad, max((a - b).abs().max().item() for a, b in zip(*grads))


def test_a_no_grad_block_in_the_forward_passes_no_gradient(ranks2):
    for with_grad, diff in ranks2.run(_no_grad_block):
        assert with_grad == [f"student.{i}.{w}" for i in (0, 2) for w in ("weight", "bias")], with_grad
        assert diff <= ROUNDOFF, diff
