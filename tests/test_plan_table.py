"""The plan table: print(plan) fits a 120-column terminal; plan.table(wide=True) keeps every column."""

import re
import runpy
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import autojigsaw
from autojigsaw.modules import short_paths
from autojigsaw.placements import compact_placements
from autojigsaw.plan import format_seconds

from .hf_models import hf_model
from .models import LinearStack

TRAIN = str(Path(__file__).resolve().parents[1] / "examples" / "train.py")
WIDE_HEADERS = ["module", "node", "op", "shapes", "inputs", "output", "kernel", "comm/rank", "comm time",
                "compute", "memory", "note"]
UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


@pytest.fixture(scope="module")
def quickstart():
    """The plan the README's Quickstart prints: examples/train.py's Llama (4 layers, 256 wide) on 2 x 2."""
    train = runpy.run_path(TRAIN, run_name="train_example")
    args = train["parse_args"]([])
    ids = train["batch_at"](0, args, None, torch.device("cpu"))
    return autojigsaw.plan(train["build_model"](args, torch.device("cpu")), (ids,), {"domain": 2, "tensor": 2},
                           device="cpu", example_kwargs={"labels": ids}, activation_checkpointing=args.recompute)


def _widest(text: str) -> int:
    return max(len(line) for line in text.splitlines())


def _seconds(cell: str) -> float:
    value, unit = cell.split()
    return float(value) * UNITS[unit]


def test_the_quickstart_plan_fits_120_columns_and_wide_keeps_every_column(quickstart):
    text, wide = str(quickstart), quickstart.table(wide=True)
    assert _widest(text) <= 120 < _widest(wide), text
    lines = text.splitlines()
    assert lines[0].split() == ["module", "op", "placements", "kernel", "comm/rank", "time"], text
    # a module path cut in the middle, its repeated layers kept; whole in the wide table
    assert "layers.{0..3}\N{HORIZONTAL ELLIPSIS}q_proj " in text and "self_attn.q_proj" not in text, text
    assert "model.layers.{0..3}.self_attn.q_proj " in wide, wide
    assert re.split(r"  +", wide.splitlines()[0].strip()) == WIDE_HEADERS, wide
    assert "aten.linear" in wide and "aten.linear" not in text
    down = quickstart.node("linear_6")  # layer 0's mlp.down_proj
    row = next(line.split("  ") for line in lines if line.startswith("layers.{0..3}.mlp.down_proj "))
    cells = [cell.strip() for cell in row if cell.strip()]
    placements = " ".join(compact_placements(p) for p in down.inputs) + " -> " + compact_placements(down.output)
    assert cells[1:3] == ["linear", placements], row
    assert ("P" in placements.split(" -> ")[1]) == any(p.is_partial() for p in down.output)
    total = next(line for line in lines if line.startswith("TOTAL"))
    assert total.endswith(" " + format_seconds(quickstart.step_time)), total


def test_the_time_column_sums_to_the_step_on_a_3d_mesh_under_fsdp():
    """FSDP's gathers are priced apart from the nodes; its row is what a step exposes of them."""
    plan = autojigsaw.plan(LinearStack(depth=2), (torch.randn(2, 5, 16),), {"data": 2, "domain": 2, "tensor": 2},
                           device="cpu")
    text = str(plan)
    assert plan.data_parallel == "fsdp" and _widest(text) <= 120, text
    lines = text.splitlines()
    rows = lines[2:next(i for i, line in enumerate(lines) if line.startswith("TOTAL"))]
    times = [_seconds(" ".join(line.split()[-2:])) for line in rows]  # each rounded to 5 us at most
    assert sum(times) == pytest.approx(plan.step_time, abs=5e-6 * len(times)), text
    assert rows[-1].startswith("(FSDP)") and times[-1] > 0 and "(FSDP):" in text, text
    every = plan.table(every_node=True)
    assert _widest(every) <= 120 and len(every.splitlines()) > len(text.splitlines()), every


def test_a_sharded_gpt2_fits_120_columns():
    model, inputs = hf_model("gpt2")
    plan = autojigsaw.plan(model, inputs, {"domain": 2, "tensor": 2}, device="cpu", memory_budget=1_000_000)
    text = str(plan)
    assert _widest(text) <= 120 and _widest(plan.table(every_node=True)) <= 120, text
    assert any(not p.is_replicate() for pl in plan.param_placements.values() for p in pl), text
    assert "h.{0..1}.mlp.c_fc " in text and "transformer.h.{0..1}.mlp.c_fc" in plan.table(wide=True), text


def test_placements_in_short_keep_partial_visible():
    assert compact_placements((Shard(0), Partial())) == "S0P"
    assert compact_placements((Replicate(), Shard(2))) == "RS2"
    assert compact_placements((Partial("max"), Shard(10), Replicate())) == "P(max)S10R"


def test_short_module_paths_are_unambiguous():
    ellipsis = "\N{HORIZONTAL ELLIPSIS}"
    paths = ["model.encoder.layers.{0..11}.self_attn.q_proj", "model.decoder.layers.{0..11}.self_attn.q_proj",
             "model.layers.{0..31}.mlp.gate_proj", "model.layers.{0..31}.self_attn.q_proj", "lm_head",
             "model.embed_tokens", "x" * 40]
    short = short_paths(paths, 28)
    assert len(set(short.values())) == len(paths), short
    assert short["model.layers.{0..31}.self_attn.q_proj"] == f"layers.{{0..31}}{ellipsis}q_proj"
    assert short["model.layers.{0..31}.mlp.gate_proj"] == "layers.{0..31}.mlp.gate_proj"
    assert short["model.encoder.layers.{0..11}.self_attn.q_proj"] == f"encoder.layers.{{0..11}}{ellipsis}q_proj"
    assert short["lm_head"] == "lm_head" and short["model.embed_tokens"] == "model.embed_tokens"
    assert len(short["x" * 40]) == 28 and ellipsis in short["x" * 40]
