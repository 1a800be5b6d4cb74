"""benchmarks/gpu_acceptance.py without a GPU: it says so and exits 0; its report, from made-up measurements."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import common, gpu_acceptance
from benchmarks.gpu_acceptance import ExampleRun, MemoryMeasurement, losses_agree, write_report

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
def test_without_a_gpu_it_says_so_and_exits_0():
    out = subprocess.run([sys.executable, "-m", "benchmarks.gpu_acceptance"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "no CUDA GPU here, nothing run" in out.stdout


def test_the_report_puts_predicted_beside_measured(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "OUT", tmp_path)
    memory = [MemoryMeasurement("eager", False, int(3.0 * GiB), int(3.1 * GiB), int(3.6 * GiB), int(3.5 * GiB),
                                "backward of cross_entropy_loss"),
              MemoryMeasurement("compiled", True, int(2.0 * GiB), int(2.6 * GiB), int(2.2 * GiB), int(2.6 * GiB)),
              MemoryMeasurement("eager", True, error="exit 1: CUDA out of memory")]
    examples = [ExampleRun("eager", 0, (10.4, 9.8, 9.1), 51_000, 31), ExampleRun("compiled", 0, (10.4, 9.8, 9.1),
                                                                                 88_000, 95)]
    write_report(memory, examples, [("linear", "eager", "1.000", "1.100", "1.10x", "0.900", "1.22x")],
                 ["case", "mode", "torch ms", "autojigsaw ms", "overhead", "predicted ms", "measured / predicted"],
                 ["memory, eager, expandable=True: exit 1: CUDA out of memory"])
    text = (tmp_path / "gpu_acceptance.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| eager") and "default segments" in line)
    assert "3.000 GiB" in row and "3.100 GiB" in row and "-3.2%" in row and "+2.9%" in row and "!" not in row
    compiled = next(line for line in text.splitlines() if line.startswith("| compiled"))
    assert "-23.1% !" in compiled and "-15.4% !" in compiled  # beyond 10 %: marked
    assert "CUDA out of memory" in text and "eager and compiled losses agree" in text and "88,000" in text


def test_eager_and_compiled_losses_must_agree():
    eager = ExampleRun("eager", 0, (10.4, 9.8))
    assert losses_agree([eager, ExampleRun("compiled", 0, (10.4001, 9.8))])
    assert not losses_agree([eager, ExampleRun("compiled", 0, (10.4, 9.5))])
    assert not losses_agree([eager, ExampleRun("compiled", 1)])  # a failed run agrees with nothing


def test_main_returns_nothing_without_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_acceptance.main([]) is None
    assert "nothing run" in capsys.readouterr().out
