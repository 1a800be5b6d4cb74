"""`autojigsaw plan`: the plan and a verdict when the model fits (exit 0), the smallest changes that fit when it
does not (exit 1), usage errors (exit 2); models from a transformers type, a config file or a function."""

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import autojigsaw
from autojigsaw.cli import main
from autojigsaw.cli.plot import memory_by_kind, time_split

from .models import LinearStack

ROOT = Path(__file__).resolve().parents[1]
TINY_LLAMA = ["--hf", "llama", "--layers", "2", "--hidden", "64", "--ffn", "128", "--heads", "4", "--kv-heads", "2",
              "--vocab", "256"]
# on the CPU spec, memory is the bytes live: the budgets below are too small for the CUDA caching allocator's
# 2 MiB segments (tests/test_memory_reserved.py prices those)
STACK = ["--model", "tests.test_cli:stack", "--device", "cpu"]


def stack(batch: int, seq: int):
    """A 4-block MLP stack on the meta device, `batch` x `seq` rows of 64 features (the --model function)."""
    torch.manual_seed(0)
    with torch.device("meta"):
        return LinearStack(d=64, hidden=256, depth=4), torch.zeros(batch, seq, 64)


def _run(argv, capsys) -> tuple[int, str, str]:
    status = main(["plan", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_a_model_that_fits_prints_its_plan_and_verdict_and_saves_them(tmp_path, capsys):
    argv = [*TINY_LLAMA, "--batch", "2", "--seq", "64", "--mesh", "data=2,tensor=2", "--device", "h100", "--mp", "bf16",
            "--json", str(tmp_path / "plan.json"), "--plot", str(tmp_path / "plan.png")]
    status, out, _ = _run(argv, capsys)
    assert status == 0, out
    verdict = next(line for line in out.splitlines() if line.startswith("fits: "))
    assert " of 72.0 GiB per GPU; predicted " in verdict and " tokens/s per GPU, " in verdict and "% MFU" in verdict
    assert "TOTAL" in out and ("plan optimal" in out or "of optimal" in out)
    saved = autojigsaw.Plan.from_json((tmp_path / "plan.json").read_text())
    assert saved.mesh.axis_names == ("data", "tensor") and saved.precision.startswith("bf16")
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_gpu_count_searches_the_mesh_and_prints_the_meshes_it_beat(tmp_path, capsys):
    argv = [*TINY_LLAMA, "--batch", "2", "--seq", "64", "--gpus", "8", "--gpus-per-node", "4", "--device", "h100",
            "--json", str(tmp_path / "plan.json")]
    status, out, _ = _run(argv, capsys)
    assert status == 0, out
    plan = autojigsaw.Plan.from_json((tmp_path / "plan.json").read_text())
    assert np.prod(plan.mesh.sizes) == 8
    rows = [line.split() for line in out.splitlines() if line.endswith(("chosen", "planned", "estimated"))]
    assert rows[0][0] == plan.mesh.describe() and rows[0][-1] == "chosen", out
    assert len(rows) > 1 and all(np.prod([int(a.split("=")[1]) for a in row[:-3] if "=" in a]) == 8
                                 for row in rows), out


def test_the_verdict_is_the_plans_own_throughput_and_peak(capsys):
    # 4 sequences of 64 tokens per data replica, 2 replicas: 512 tokens a step over 4 GPUs
    status, out, _ = _run([*TINY_LLAMA, "--batch", "4", "--seq", "64", "--mesh", "data=2,tensor=2", "--device", "h100",
                           "--mip-gap", "0"], capsys)
    import transformers

    config = transformers.AutoConfig.for_model("llama", num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                               use_cache=False)
    with torch.device("meta"):
        model, ids = transformers.AutoModelForCausalLM.from_config(config), torch.zeros(8, 64, dtype=torch.long)
    plan = autojigsaw.plan(model, (ids,), {"data": 2, "tensor": 2}, device="h100", example_kwargs={"labels": ids},
                           mip_gap=0)
    assert status == 0 and f"predicted {8 * 64 / plan.step_time / 4:,.0f} tokens/s per GPU" in out, out


def test_a_config_file_and_a_model_type_with_overrides_plan_alike(tmp_path, capsys):
    import transformers

    config = transformers.AutoConfig.for_model("llama", num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    config.to_json_file(tmp_path / "config.json")
    run = ["--batch", "2", "--seq", "32", "--mesh", "tensor=2", "--mip-gap", "0"]
    plans = []
    for source in (TINY_LLAMA, ["--config", str(tmp_path / "config.json")]):
        assert _run([*source, *run, "--json", str(tmp_path / "p.json")], capsys)[0] == 0
        plans.append(autojigsaw.Plan.from_json((tmp_path / "p.json").read_text()))
    assert plans[0].fingerprint() == plans[1].fingerprint()


def test_a_model_that_does_not_fit_exits_1_naming_the_smallest_changes_that_fit(capsys):
    status, out, _ = _run([*STACK, "--batch", "8", "--seq", "32", "--mesh", "tensor=2", "--budget", "2000000"], capsys)
    assert status == 1 and out.startswith("does not fit: batch 8 per replica on tensor=2: no plan fits"), out
    changes = out.split("fits with (fastest first):\n")[1].splitlines()
    flags = [line.split(":")[0].strip() for line in changes if line.startswith("  ")]
    assert sorted(flags) == ["--batch 4", "--mesh tensor=4", "--recompute auto"], out
    assert f"smallest change: {flags[0]}" in out
    for flag in flags:  # each change named does fit
        changed = {"--batch": ["--batch", "4"], "--mesh": ["--batch", "8", "--mesh", "tensor=4"],
                   "--recompute": ["--batch", "8", "--recompute", "auto"]}[flag.split()[0]]
        base = ["--seq", "32", "--budget", "2000000"] + ([] if flag.startswith("--mesh") else ["--mesh", "tensor=2"])
        assert _run([*STACK, *base, *changed], capsys)[0] == 0, flag


def test_when_nothing_tried_fits_it_says_so(capsys):
    status, out, _ = _run([*STACK, "--batch", "8", "--seq", "32", "--mesh", "tensor=2", "--budget", "100KiB"], capsys)
    assert status == 1 and "no change tried fits" in out


@pytest.mark.parametrize("argv, message", [
    (["--mesh", "tensor2"], "--mesh 'tensor2': give axis=size pairs"),
    (["--mesh", "tensor=2", "--budget", "lots"], "--budget 'lots': give bytes per GPU with a unit"),
    (["--mesh", "tensor=2", "--batch", "0"], "--batch 0: give at least 1"),
    (["--mesh", "tensor=2", "--device", "tpu"], "tpu"),
])
def test_a_usage_error_exits_2_naming_the_argument(argv, message, capsys):
    status, _, err = _run([*STACK, "--seq", "8", *argv], capsys)
    assert status == 2 and message in err, err


def test_the_command_leaves_the_library_logger_as_it_found_it(capsys):
    logger = logging.getLogger("autojigsaw")
    handlers, level = list(logger.handlers), logger.level
    _run([*STACK, "--seq", "8", "--mesh", "tensor=2", "--batch", "0"], capsys)
    # a handler left on the captured stderr of this test would write into a closed stream in the next
    assert logger.handlers == handlers and logger.level == level


def test_without_matplotlib_the_plot_says_how_to_install_it(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    status, _, err = _run([*STACK, "--seq", "8", "--mesh", "tensor=2", "--plot", str(tmp_path / "p.png")], capsys)
    assert status == 2 and "pip install 'autojigsaw[plot]'" in err


def test_the_plots_memory_by_kind_adds_up_to_the_plans_peak_and_its_time_to_the_step():
    model, x = stack(8, 32)
    for options in ({}, {"activation_checkpointing": "full", "memory_budget": 2_000_000}):
        plan = autojigsaw.plan(model, (x,), {"tensor": 2}, device="cpu", **options)
        kinds = memory_by_kind(plan)
        total = sum(kinds.values())
        assert total.max() == pytest.approx(plan.memory_per_rank, rel=1e-9)  # bytes live: the CPU spec's peak
        params = plan.explainer.problem.memory.vectors  # every kind is there for a training step
        assert all(kinds[k].max() > 0 for k in ("parameters", "gradients", "optimizer state", "activations")), params
        assert np.all(kinds["gradients"][:len(plan.nodes)] == 0)  # no gradient before the backward
        assert sum(time_split(plan).values()) == pytest.approx(plan.step_time, rel=1e-9)


def test_python_m_autojigsaw_and_the_console_script_run_the_command_line(tmp_path):
    argv = ["plan", *STACK, "--seq", "8", "--mesh", "tensor=2", "--json", str(tmp_path / "p.json")]
    script = Path(sys.executable).with_name("autojigsaw")
    for command in ([sys.executable, "-m", "autojigsaw", *argv], [str(script), *argv]):
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and "fits: " in done.stdout, done.stderr
        assert json.loads((tmp_path / "p.json").read_text())["mesh"]["sizes"] == [2]
