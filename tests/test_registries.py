"""The registries are filled by a listed set of files: a rule file missing from
strategies/rules/__init__.py's RULE_MODULES fails here instead of silently not existing."""

import re
import sys
from pathlib import Path

import autojigsaw
from autojigsaw.kernels.registry import registered_kernels, registered_local_costs
from autojigsaw.strategies import rules
from autojigsaw.strategies.rules.base import registered_rules

PACKAGE = Path(autojigsaw.__file__).parent
REGISTERS = re.compile(r"^@register\(|\badd\(Kernel\(|\blocal_cost\(", re.MULTILINE)


def _registering_modules() -> set[str]:
    """The modules that registered a rule, a kernel (the module of its call, else of its cost) or a local
    cost, by the functions they registered (a kernel's traffic may be a helper's)."""
    functions = [*registered_rules().values(), *registered_local_costs().values()]
    functions += [next(fn for fn in (kernel.build, kernel.cost, kernel.traffic) if fn is not None)
                  for kernel in registered_kernels().values()]
    return {fn.__module__ for fn in functions}


def test_every_rule_file_is_listed_and_each_listed_one_registers():
    files = {path.stem for path in Path(rules.__file__).parent.glob("*.py")} - {"__init__"}
    listed = {module.__name__.rpartition(".")[2] for module in rules.RULE_MODULES}
    assert files - set(rules.HELPERS) == listed, (
        f"rule files not in RULE_MODULES (their rules would not exist): {sorted(files - set(rules.HELPERS) - listed)}")
    registering = _registering_modules()
    assert not [m.__name__ for m in rules.RULE_MODULES if m.__name__ not in registering]
    assert not [h for h in rules.HELPERS if f"{rules.__name__}.{h}" in registering]


def test_every_file_that_registers_is_imported_with_autojigsaw():
    """Outside the rules: the kernels the rewrite's passes insert (fuse, bucket) and the registry's own."""
    registering = _registering_modules()
    for path in sorted(PACKAGE.rglob("*.py")):
        if REGISTERS.search(path.read_text()):
            name = ".".join(("autojigsaw", *path.relative_to(PACKAGE).with_suffix("").parts))
            assert name in sys.modules and name in registering, f"{name} registers, but nothing imports it"

