"""docs/ops.md, generated from the rule registries: what autojigsaw shards, runs replicated or refuses.

    python -m autojigsaw.strategies.ops_table > docs/ops.md

tests/test_ops_table.py regenerates it and compares, so the table cannot go stale.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass

import torch

from .dtensor_rules import _NO_EMPTY_INPUT, _PROPAGATOR
from .rules.base import registered_rules


@dataclass(frozen=True)
class Pattern:
    """A way of writing a model autojigsaw does not shard, what happens, and the test that shows it."""

    pattern: str
    outcome: str
    test: str  # tests/<file>.py::<test function>


PATTERNS = (
    Pattern("data-dependent Python control flow (`if x.sum() > 0:`)",
            "ValueError: torch.export could not capture the model; remove data-dependent control flow",
            "tests/test_errors.py::test_uncapturable_model"),
    Pattern("an in-place op on a model input (`x.mul_(2)`)",
            "ValueError naming the input: autojigsaw does not write results back into inputs",
            "tests/test_ops_table.py::test_in_place_op_on_an_input_is_refused"),
    Pattern("a sparse input tensor (`x.to_sparse()`)",
            "ValueError naming the input and its layout: pass a dense tensor",
            "tests/test_ops_table.py::test_sparse_input_is_refused"),
    Pattern("an integer tensor where a float is expected (`nn.Linear` on int64 ids)",
            "ValueError naming the node, its module and the dtypes: cast the input, or use an embedding",
            "tests/test_ops_table.py::test_integer_input_to_a_float_layer_is_refused"),
    Pattern("a complex input tensor (`torch.view_as_real(z * z)`)",
            "sharded like any other; equal to one device",
            "tests/test_ops_table.py::test_complex_input_shards_and_matches_one_device"),
    Pattern("an op no rule covers (`torch.diff`)",
            "runs replicated (`fallback` in the plan table), equal to one device",
            "tests/test_ops_table.py::test_op_without_a_rule_runs_replicated_and_matches_one_device"),
    Pattern("a custom `torch.autograd.Function` (a straight-through round)",
            "ValueError naming the Function: export drops its backward; with the detach rewrite that keeps it",
            "tests/test_errors.py::test_custom_autograd_function_is_refused_and_its_rewrite_trains"),
    Pattern("a custom `torch.autograd.Function` whose backward is its forward's derivative (Bloom's GELU)",
            "trains: checked once on seeded fp64 inputs of its shapes, the forward's ops give its gradient",
            "tests/test_model_idioms.py::test_bloom_with_its_fused_gelu_function_trains_like_one_device"),
    Pattern("slices of a new buffer written with copy_ (`k = x.new_empty(...); k[..., :n].copy_(a)`, DeepSeek-V3)",
            "each write becomes what it computes (its source broadcast and cast), which autograd differentiates",
            "tests/test_model_idioms.py::test_keys_written_into_a_buffer_train_like_one_device"),
    Pattern("a gradient hook registered in the forward (`h.register_hook(lambda g: -g)`)",
            "ValueError naming the line: export drops the hook; with the detach rewrite that keeps it",
            "tests/test_errors.py::test_gradient_hook_in_the_forward_is_refused_and_its_rewrite_trains"),
    Pattern("a module backward hook (Opacus, a gradient scale), or a parameter hook registered before parallelize",
            "ValueError naming the module or parameter; a hook on pmodel or on its parameters runs",
            "tests/test_errors.py::test_backward_hooks_parallelize_would_drop_are_refused"),
    Pattern("a module forward hook that returns nothing (it collects features or statistics)",
            "ValueError naming the module: it would run once, at capture; a hook on pmodel, or one that returns "
            "the output it changes, runs",
            "tests/test_errors.py::test_forward_hook_that_collects_is_refused"),
    Pattern("a forward that sets an attribute on its module (`self.aux_loss = ...`, a call counter)",
            "ValueError naming the module, attribute and line: it would be set once, at capture; return it, or "
            "keep it in a buffer updated in place",
            "tests/test_errors.py::test_attribute_set_in_the_forward_is_refused"),
    Pattern("a gradient of a gradient (`create_graph=True`: a gradient penalty)",
            "ValueError naming the kernel and mesh axis: the kernels are differentiable once",
            "tests/test_gradient_paths.py::test_a_gradient_of_a_gradient_is_refused"),
    Pattern("a write into part of a complex tensor (`out[..., :m] = z`, a spectral convolution)",
            "ValueError naming the node: its *_scatter has no complex autograd; build it with pad or cat",
            "tests/test_errors.py::test_complex_write_into_a_slice_is_refused"),
    Pattern("FSDP over parameters of two dtypes (a complex weight beside real ones)",
            "ValueError naming a parameter of the rarer dtype: one dtype, or data_parallel='ddp'",
            "tests/test_errors.py::test_fsdp_of_parameters_of_two_dtypes_is_refused"),
    Pattern("FSDP over a scalar parameter (CLIP's `logit_scale`, a ReZero gate)",
            "kept whole on the data axis (FSDP2 shards dim 0, which it lacks); the program sums its gradient",
            "tests/test_data_parallel.py::test_fsdp_keeps_scalar_parameters_whole_and_trains_like_one_device"),
    Pattern("many outputs beside a returned loss (CLIP: ten tensors)",
            "the largest come back as planned, the others whole: at most 4,096 choices for the outputs together",
            "tests/test_model_idioms.py::test_many_outputs_beside_a_loss_plan_in_seconds"),
    Pattern("a batch smaller than the ranks of a data axis",
            "ValueError naming the axis and the batch",
            "tests/test_data_parallel.py::test_a_batch_smaller_than_the_data_axis_is_refused"),
)


def _name(op) -> str:
    return str(op).removeprefix("aten.")


def _core_ops():
    """The core ATen opset (what torch.export's decompositions produce)."""
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name, None)
        for overload in getattr(packet, "overloads", list)():
            op = getattr(packet, overload)
            if torch.Tag.core in op.tags:
                yield op


def dtensor_rules() -> dict[str, list[str]]:
    """DTensor's rule function -> the ops it covers (that autojigsaw's own rules do not take)."""
    by_rule = defaultdict(list)
    funcs = {**_PROPAGATOR.op_strategy_funcs,
             **{op: info.func for op, info in _PROPAGATOR.op_single_dim_strategy_funcs.items()}}
    own = registered_rules()
    for op, fn in funcs.items():
        if op not in own:
            by_rule[getattr(fn, "__name__", type(fn).__name__)].append(_name(op))
    return {rule: sorted(ops) for rule, ops in sorted(by_rule.items())}


def table() -> str:
    rules = registered_rules()
    own = sorted(rules.items(), key=lambda kv: _name(kv[0]))
    dtensor = dtensor_rules()
    covered = set(rules) | set(_PROPAGATOR.op_strategy_funcs) | set(_PROPAGATOR.op_single_dim_strategy_funcs)
    fallback = sorted({_name(op) for op in _core_ops() if op not in covered})
    lines = [
        "# Supported ops and patterns",
        "",
        f"Generated from the rule registries with torch {torch.__version__.split('+')[0]} by",
        "`python -m autojigsaw.strategies.ops_table > docs/ops.md`; do not edit by hand.",
        "",
        "Every node of the captured ATen graph gets its strategies from autojigsaw's own rule for its op",
        "(first), else from DTensor's, else it runs replicated: the whole tensor on every rank, marked",
        "`fallback` in the plan table -- slower, never wrong. The planner picks among the strategies.",
        "An op that draws random numbers (tag `nondeterministic_seeded`) and has no rule of its own takes",
        "`random_draws.draws` while it draws, before DTensor's (which would give every shard the same numbers).",
        "",
        f"## Sharded by autojigsaw's rules ({len(own)} ops)",
        "",
        "| op | rule |",
        "|---|---|",
        *(f"| `{_name(op)}` | `{fn.__module__.removeprefix('autojigsaw.')}.{fn.__name__}` |" for op, fn in own),
        "",
        f"## Sharded by DTensor's rules ({sum(map(len, dtensor.values()))} ops, {len(dtensor)} rules)",
        "",
        "Only strategies in plain `Shard` / `Replicate` / `Partial` placements are used (DTensor's private",
        "variants need its runtime). For " + ", ".join(f"`{_name(op)}`" for op in sorted(_NO_EMPTY_INPUT, key=str))
        + " the strategies that would leave a rank an empty input are dropped (the kernels refuse one).",
        "",
        "| DTensor rule | ops |",
        "|---|---|",
        *(f"| `{rule}` | {', '.join(f'`{op}`' for op in ops)} |" for rule, ops in dtensor.items()),
        "",
        f"## Replicated: core ATen ops no rule covers ({len(fallback)})",
        "",
        "Any op outside the two lists above runs replicated; these are the ones of the core ATen opset.",
        "",
        ", ".join(f"`{op}`" for op in fallback),
        "",
        "## Patterns autojigsaw does not shard",
        "",
        "| pattern | what happens | test |",
        "|---|---|---|",
        *(f"| {p.pattern} | {p.outcome} | `{p.test}` |" for p in PATTERNS),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(table())
