"""Tests and benchmarks use autojigsaw's public seams: no assignment into autojigsaw.api, no
`_private` name of autojigsaw imported or read, no private attribute of a ParallelModule read.
What they need has a public form: `Options.solver`, `ParallelModule.program` / `.programs`,
`planner.milp.MilpBuilder`."""

import ast
import dataclasses
import inspect
import typing
from pathlib import Path

import pytest
import torch

import autojigsaw
from autojigsaw.cost_model.memory import OPTIMIZERS, OptimizerName
from autojigsaw.planner import solve
from autojigsaw.runtime import module as runtime_module
from autojigsaw.training import DATA_PARALLEL_CHOICES, RECOMPUTE_CHOICES

from .models import build

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(p for folder in ("tests", "benchmarks") for p in (ROOT / folder).glob("*.py"))
SWAP = "swaps a function of autojigsaw.api"
PATCHERS = {"setattr", "object"}  # setattr(m, ...), monkeypatch.setattr(m, ...), mock.patch.object(m, ...)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _dotted(node: ast.AST) -> str | None:
    """`a.b.c` of a Name or an Attribute chain of Names, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


class _Seams(ast.NodeVisitor):
    """Every way one file reaches past autojigsaw's public seams, as 'line: what'."""

    def __init__(self, private_attributes: set[str]):
        self.modules: dict[str, str] = {}  # local name -> the autojigsaw module it is bound to
        self.private_attributes = private_attributes
        self.found: list[str] = []

    def swap(self, line: int, text: str) -> None:
        self.found.append(f"{line}: {text} ({SWAP})")

    def module_of(self, node: ast.AST) -> str | None:
        dotted = _dotted(node)
        if dotted is None:
            return None
        head, _, rest = dotted.partition(".")
        if head not in self.modules:
            return None
        return ".".join(filter(None, [self.modules[head], rest]))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] == "autojigsaw":
                self.modules[alias.asname or "autojigsaw"] = alias.name if alias.asname else "autojigsaw"
                if any(_private(part) for part in alias.name.split(".")):
                    self.found.append(f"{node.lineno}: import {alias.name}")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if (node.module or "").split(".")[0] == "autojigsaw":
            for alias in node.names:
                if _private(alias.name) or any(_private(part) for part in node.module.split(".")):
                    self.found.append(f"{node.lineno}: from {node.module} import {alias.name}")
                self.modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if _private(node.attr) and (self.module_of(node.value) or node.attr in self.private_attributes):
            self.found.append(f"{node.lineno}: {ast.unparse(node)}")
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._assigned(target, node.lineno)
        self.generic_visit(node)

    def _assigned(self, target: ast.AST, line: int) -> None:
        if isinstance(target, ast.Tuple):
            for t in target.elts:
                self._assigned(t, line)
        elif isinstance(target, ast.Attribute) and _in_api(self.module_of(target.value)):
            self.swap(line, f"{ast.unparse(target)} = ...")

    def visit_Call(self, node: ast.Call) -> None:
        name = _dotted(node.func) or ""
        if name.rpartition(".")[2] in PATCHERS and node.args:
            target = node.args[0]
            text = target.value if isinstance(target, ast.Constant) and isinstance(target.value, str) else None
            if _in_api(self.module_of(target)) or (text or "").startswith("autojigsaw.api."):
                self.swap(node.lineno, ast.unparse(node)[:80])
        if name in ("mock.patch", "patch", "unittest.mock.patch") and node.args:
            target = node.args[0]
            if isinstance(target, ast.Constant) and str(target.value).startswith("autojigsaw.api."):
                self.swap(node.lineno, ast.unparse(node)[:80])
        self.generic_visit(node)


def _in_api(module: str | None) -> bool:
    """Whether a module name is autojigsaw.api or one of its modules."""
    return module is not None and (module == "autojigsaw.api" or module.startswith("autojigsaw.api."))


def _parallel_module_privates() -> set[str]:
    """The private attributes and methods of a ParallelModule (its own; nn.Module's are torch's), and the
    parts of its Program under a private name (`_graph`, `_rank`: `.program.graph`, `.program.rank`)."""
    tree = ast.parse(inspect.getsource(runtime_module.ParallelModule))
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and _dotted(n.value) == "self"}
    names |= {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    names |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
              and n.value.isidentifier()}  # object.__setattr__(self, "_active", ...)
    names |= {f"_{field.name}" for field in dataclasses.fields(runtime_module.Program)} | {"_program"}
    torch_own = set(dir(torch.nn.Module)) | set(vars(torch.nn.Module()))
    return {name for name in names if _private(name) and name not in torch_own}


def _reaching_in(source: str) -> list[str]:
    seams = _Seams(_parallel_module_privates())
    seams.visit(ast.parse(source))
    return seams.found


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_tests_and_benchmarks_use_public_seams_only(path):
    found = _reaching_in(path.read_text())
    assert not found, f"{path.relative_to(ROOT)} reaches past the public API:\n" + "\n".join(found)


def test_the_check_sees_each_way_of_reaching_in():
    source = """
import autojigsaw.api
import autojigsaw.api as api
from autojigsaw import api as recipe
from autojigsaw.planner.milp import _Builder
from autojigsaw.planner import milp
autojigsaw.api.solve = None
api.plan_captured, x = None, 1
monkeypatch.setattr(recipe, "solve", None)
mock.patch.object(api, "annotate", None)
monkeypatch.setattr("autojigsaw.api.solve", None)
milp._SCALE
pmodel._programs
auto._graph.graph
"""
    assert [line.split(":")[0] for line in _reaching_in(source)] == [
        "5", "7", "8", "9", "10", "11", "12", "13", "14"], _reaching_in(source)


def test_the_option_keywords_are_options_fields_with_their_closed_choices():
    hints = typing.get_type_hints(autojigsaw.Options)
    assert typing.get_args(hints["activation_checkpointing"]) == RECOMPUTE_CHOICES
    assert DATA_PARALLEL_CHOICES == typing.get_args(typing.get_args(hints["data_parallel"])[0])
    assert set(typing.get_args(OptimizerName)) == set(OPTIMIZERS)
    model, x = build("mlp", torch.float64), torch.randn(4, 8, 16, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"plan\(\) got an unexpected keyword argument 'devise'.*'device'"):
        autojigsaw.plan(model, (x,), {"tensor": 2}, devise="cpu")


def test_the_solver_option_is_the_solve_each_plan_calls():
    model, x = build("mlp", torch.float64), torch.randn(4, 8, 16, dtype=torch.float64)
    budgets = []

    def recorded(problem, budget, **kw):
        budgets.append(budget)
        return solve(problem, budget, **kw)

    plan = autojigsaw.plan(model, (x,), {"tensor": 2}, device="cpu", memory_budget=10**9, solver=recorded)
    assert budgets == [10**9]
    assert plan.fingerprint() == autojigsaw.plan(model, (x,), {"tensor": 2}, device="cpu",
                                                 memory_budget=10**9).fingerprint()


def test_a_parallel_modules_program_is_public_and_read_only():
    assert isinstance(inspect.getattr_static(autojigsaw.ParallelModule, "program"), property)
    assert inspect.getattr_static(autojigsaw.ParallelModule, "program").fset is None
    assert isinstance(inspect.getattr_static(autojigsaw.ParallelModule, "programs"), property)
