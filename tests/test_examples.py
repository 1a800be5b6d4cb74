"""Every example with a `__main__` runs as a user runs it: `python examples/<name>.py`.

examples/train.py runs under torchrun in tests/test_train_example.py; the others start their own
4 CPU ranks, and each must print the single-device comparison it promises, within its tolerance.
"""

import os
import re
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
ELSEWHERE = {"train.py"}  # under torchrun, tests/test_train_example.py


def run_example(name: str) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name)], capture_output=True, text=True,
                          env=ENV, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_every_example_with_a_main_is_run_by_a_test():
    mains = {p.name for p in (ROOT / "examples").glob("*.py") if '__name__ == "__main__"' in p.read_text()}
    assert mains == {"demo.py", "weather_mixer.py"} | ELSEWHERE, mains


def test_demo_matches_one_device():
    out = run_example("demo.py")
    diffs = {k: float(v) for k, v in re.findall(r"^  (output|gradient|parameter) +(\S+)$", out, re.M)}
    assert set(diffs) == {"output", "gradient", "parameter"} and max(diffs.values()) < 1e-4, out
    assert "OK: matches the single-device model" in out and re.search(r"^\S+ +linear +", out, re.M), out  # the plan


def test_weather_mixer_trains_from_row_shards_like_one_device():
    out = run_example("weather_mixer.py")
    rows = re.findall(r"^ +(\d+) +(\S+) +(\S+)$", out, re.M)
    assert [int(step) for step, _, _ in rows] == [0, 1, 2], out
    assert all(abs(float(mesh) - float(one)) < 1e-5 for _, mesh, one in rows), out
    assert "each rank read 6144 of the 24576 values of every sample" in out, out
