"""Every benchmark runs at a tiny size, so that none of them can rot (no timings are checked).

`python -m benchmarks.run_all --tiny` runs in a fresh process (it starts its own gloo ranks
and a one-process group), writing its tables to a temporary folder.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def test_run_all_tiny(tmp_path):
    # a plan the MILP time limit cut short fails here too, as in the tests (pyproject.toml)
    env = {**os.environ, "AUTOJIGSAW_BENCH_OUT": str(tmp_path), "PYTHONWARNINGS": "error:planner:UserWarning"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run_all", "--tiny"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for name in ("step_time", "scaling", "gpu_overhead", "published", "jigsaw_runs", "cnn_domain", "benchmarks"):
        text = (tmp_path / f"{name}.md").read_text()
        assert "|" in text, f"{name}.md has no table:\n{text}"
    step = (tmp_path / "step_time.md").read_text()
    for impl in ("single", "pytorch", "megatron", "autojigsaw"):
        assert f"| {impl}" in step


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message is for machines without a GPU")
def test_gpu_script_says_it_did_not_run(capsys):
    from benchmarks import gpu_overhead

    assert gpu_overhead.main([]) is None
    assert "no CUDA GPU" in capsys.readouterr().out
