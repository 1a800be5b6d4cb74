"""docs/ops.md is what the registries say today, and every pattern it lists is shown by a test."""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autojigsaw
from autojigsaw.strategies.ops_table import PATTERNS
from autojigsaw.testing.local_ranks import get_mesh

ROOT = Path(__file__).resolve().parents[1]
X = torch.randn(2, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))


def test_ops_md_is_generated_from_the_registries():
    # In a fresh process, as the command runs: modules other tests import may register more rules.
    fresh = subprocess.run([sys.executable, "-m", "autojigsaw.strategies.ops_table"], capture_output=True, text=True,
                           cwd=ROOT, check=True).stdout
    assert (ROOT / "docs" / "ops.md").read_text() == fresh, (
        "docs/ops.md is stale: regenerate it with `python -m autojigsaw.strategies.ops_table > docs/ops.md`")


def test_every_pattern_names_a_test_that_exists():
    for p in PATTERNS:
        path, name = p.test.split("::")
        assert f"def {name}(" in (ROOT / path).read_text(), p


class _InPlace(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16, dtype=torch.float64)

    def forward(self, x):
        x.mul_(2)
        return self.fc(x)


def test_in_place_op_on_an_input_is_refused():
    with pytest.raises(ValueError, match=r"_InPlace writes in place into its input\(s\) \['x'\]: .*\(x = x \* 2"):
        autojigsaw.plan(_InPlace(), (X.clone(),), {"tensor": 2}, device="cpu")


def test_sparse_input_is_refused():
    with pytest.raises(ValueError, match=r"input args\[0\] is a torch.sparse_coo tensor: .*\(\.to_dense\(\)\)"):
        autojigsaw.plan(torch.nn.Linear(16, 16), (X[0].float().to_sparse(),), {"tensor": 2}, device="cpu")


class _Diff(torch.nn.Module):
    """torch.diff with a prepend has no sharding rule (without one it shards the other dims): it runs
    replicated between two sharded linears."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(16, 128, dtype=torch.float64)
        self.fc2 = torch.nn.Linear(128, 16, dtype=torch.float64)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return self.fc2(torch.diff(h, dim=1, prepend=h[:, :1]))


def _side_by_side(make, x, plan_json: str) -> dict:
    """Output and every parameter's gradient of `make()` on 2 ranks against one device, relative."""
    ref = make()
    pmodel = autojigsaw.parallelize(copy.deepcopy(ref), get_mesh((2,), ("tensor",)), (x,), compile=False,
                                    plan=autojigsaw.Plan.from_json(plan_json))
    out, want = pmodel(x), ref(x)
    out.square().sum().backward()
    want.square().sum().backward()
    grads = max(((p.grad.full_tensor() - q.grad).abs().max() / q.grad.abs().max()).item()
                for p, q in zip(pmodel.parameters(), ref.parameters()))
    return {"output": ((out - want).abs().max() / want.abs().max()).item(), "grads": grads}


def _sharding_plan(make, x, fraction: float) -> autojigsaw.Plan:
    """The tensor=2 plan of `make()` under `fraction` of its 1-rank memory."""
    whole = autojigsaw.plan(make(), (x,), {"tensor": 1}, device="cpu").memory_per_rank
    return autojigsaw.plan(make(), (x,), {"tensor": 2}, device="cpu", memory_budget=int(fraction * whole))


def test_op_without_a_rule_runs_replicated_and_matches_one_device(ranks2):
    plan = _sharding_plan(_Diff, X, 0.8)
    assert [n.note for n in plan.fallbacks] == ["no sharding rule for diff.default"], plan.table()
    assert any(not p.is_replicate() for pl in plan.param_placements.values() for p in pl), plan.table()
    eps = torch.finfo(torch.float64).eps
    for r in ranks2.run(_side_by_side, _Diff, X, plan.to_json()):
        assert r["output"] <= 16 * eps and r["grads"] <= 16 * eps, r  # a few roundoffs of the largest entry


def test_integer_input_to_a_float_layer_is_refused():
    with pytest.raises(ValueError, match=r"node linear .* dtypes \['torch.int64', 'torch.float32'.*cast the input"):
        autojigsaw.plan(torch.nn.Linear(16, 16), (torch.ones(4, 16, dtype=torch.int64),), {"tensor": 2}, device="cpu")


class _ComplexIn(torch.nn.Module):
    """A complex input, squared, seen as real pairs by two linears."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(32, 256)
        self.fc2 = torch.nn.Linear(256, 32)

    def forward(self, z):
        return self.fc2(torch.relu(self.fc1(torch.view_as_real(z * z).flatten(-2))))


Z = torch.randn(8, 16, dtype=torch.complex64, generator=torch.Generator().manual_seed(1))


def test_complex_input_shards_and_matches_one_device(ranks2):
    plan = _sharding_plan(_ComplexIn, Z, 0.7)
    assert any(not p.is_replicate() for pl in plan.param_placements.values() for p in pl), plan.table()
    eps = torch.finfo(torch.float32).eps
    for r in ranks2.run(_side_by_side, _ComplexIn, Z, plan.to_json()):
        assert r["output"] <= 16 * eps and r["grads"] <= 16 * eps, r  # a few roundoffs of the largest entry
