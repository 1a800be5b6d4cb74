"""examples/train.py as a user runs it: torchrun, a checkpoint, --resume, bad input.

The script builds the same weights and batches on any mesh, so a 2-rank run (2 steps, then 2
more resumed from its checkpoint) must print the losses of a 1-rank run of 4 steps, to fp32
rounding. Bad input must end the run before any process group starts, with one line naming
the fix: under torchrun once, and in this process (the checks need no launcher) for the rest.
"""

import math
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "examples" / "train.py")
TINY = ["--layers", "2", "--hidden", "64", "--vocab", "256", "--batch", "4", "--seq", "16"]
SHARDED = ["--mesh", "2", "--memory-budget", "2"]  # 2 MiB per rank: it needs 3.2 MiB whole, so it shards
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}


def torchrun(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            SCRIPT, *TINY, *args]


def start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)


def finish(proc: subprocess.Popen, timeout: float = 180) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def one_rank(*args: str) -> list[str]:
    """The script without a launcher: one rank."""
    return [sys.executable, SCRIPT, *TINY, "--mesh", "1", *args]


def losses(out: str) -> dict[int, float]:
    """{step: loss} from the lines rank 0 prints."""
    return {int(m[1]): float(m[2]) for m in re.finditer(r"^step +(\d+) +loss +(\S+)", out, re.M)}


def test_parallel_and_resumed_losses_equal_one_rank(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    single = start(one_rank("--steps", "4", "--checkpoint-dir", ""))  # alongside the parallel runs
    rc, first, err = finish(start(torchrun(2, *SHARDED, "--steps", "2", "--checkpoint-dir", ckpt)))
    assert rc == 0, first + err
    assert re.search(r"^\S+ +\S+.* aten\.linear .* S\(\d\)", first, re.M), "the plan shards no linear"
    assert "tokens/s" in first and "peak RSS MiB per rank" in first
    assert (Path(ckpt) / "latest").read_text().strip() == "step-000002"
    rc, resumed, err = finish(start(torchrun(2, *SHARDED, "--steps", "4", "--checkpoint-dir", ckpt, "--resume")))
    assert rc == 0, resumed + err
    assert "resuming after step 2" in resumed
    rc, out, err = finish(single)
    assert rc == 0, out + err
    parallel, reference = losses(first) | losses(resumed), losses(out)
    assert sorted(parallel) == sorted(reference) == [1, 2, 3, 4]
    assert all(math.isfinite(v) for v in parallel.values())
    assert reference[4] < reference[1]  # it learns
    for step, loss in reference.items():  # printed to 6 decimals: fp32 rounding of a loss near 5
        assert parallel[step] == pytest.approx(loss, abs=2e-6), (step, parallel, reference)


def test_bad_input_exits_with_one_line(tmp_path, capsys):
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "tokens.bin")
    # Through the launchers: a mesh that does not fit torchrun's ranks; a good token file.
    mesh = start(torchrun(2, "--mesh", "2x2"))
    data = start(one_rank("--steps", "1", "--checkpoint-dir", "", "--data", str(tmp_path / "tokens.bin"),
                          "--vocab", "1000"))
    # The other checks run before any process group too: call the script's main in this process.
    np.save(tmp_path / "floats.npy", np.zeros(1000, np.float32))
    train = runpy.run_path(SCRIPT, run_name="train_example")
    one = [*TINY, "--mesh", "1", "--steps", "1", "--checkpoint-dir", ""]
    cases = {
        "unknown --model 'bert': choose one of llama, gpt2": ["--model", "bert"],
        "--mesh 'ax2' is not a mesh: write 4, 2x2, 2x2x2 or data=2,tensor=2": ["--mesh", "ax2"],
        "--data nope.npy: no such file": ["--data", "nope.npy"],
        "holds float32, not token ids": ["--data", str(tmp_path / "floats.npy")],
        "give the --data-dtype it was written with": ["--data", str(tmp_path / "tokens.bin"), "--data-dtype", "int32"],
        "has token id 999, outside --vocab 256: give --vocab 1000": ["--data", str(tmp_path / "tokens.bin")],
        f"--resume: no checkpoint in {tmp_path}/": ["--resume", "--checkpoint-dir", str(tmp_path)],
    }
    for expected, args in cases.items():
        assert train["main"]([*one, *args]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("train.py: error: ") and err.count("\n") == 1 and expected in err, (args, err)
    rc, out, err = finish(mesh, timeout=120)
    assert rc != 0
    lines = [line for line in err.splitlines() if line.startswith("train.py: error:")]
    assert lines == ["train.py: error: --mesh 2x2 has 4 ranks but 2 were started: give a mesh of 2 ranks, "
                     "or start 4 (torchrun --nproc-per-node, --nnodes)"], err  # one line, from local rank 0
    rc, out, err = finish(data, timeout=120)
    assert rc == 0, out + err
    assert math.isfinite(losses(out)[1])
