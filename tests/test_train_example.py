"""examples/train.py as a user runs it: torchrun, a checkpoint, --resume, bad input.

The script builds the same weights and batches on any mesh, so a 2-rank run of 4 steps (killed
while saving its second checkpoint), and the runs resumed from its first checkpoint on the same 2
ranks, on a domain=2 mesh and on a pipe=2 mesh (two pipeline stages under train_step), must print
the losses of a 1-rank run of 4 steps, to fp32 rounding. Bad input must end the run before any
process group starts, with one line naming the fix: under torchrun once, and in this process (the
checks need no launcher) for the rest.
"""

import math
import os
import re
import runpy
import shutil
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


# Run as the script, but rank 1 dies after writing its files of the second checkpoint: mid-save.
CRASH_IN_SECOND_SAVE = f"""
import os, runpy, sys
from torch.distributed.checkpoint.filesystem import FileSystemWriter
write, calls = FileSystemWriter.write_data, []
def write_then_die(self, plan, planner):
    calls.append(1)
    future = write(self, plan, planner)
    if len(calls) == 2 and os.environ["RANK"] == "1":
        future.wait()
        os._exit(17)
    return future
FileSystemWriter.write_data = write_then_die
sys.argv[0] = {SCRIPT!r}
runpy.run_path({SCRIPT!r}, run_name="__main__")
"""


def test_parallel_crashed_and_resumed_losses_equal_one_rank(tmp_path):
    """One rank, 4 steps; 2 ranks on tensor=2, 4 steps, saving at 2 and killed while saving at 4;
    resumed from step 2 on the same mesh, and on domain=2, which replicates the weights the
    checkpoint holds split (DCP reshards them and Adam's state; 2 -> 4 ranks: tests/test_checkpoint.py)."""
    ckpt, other, piped = tmp_path / "ckpt", tmp_path / "other", tmp_path / "piped"
    single = start(one_rank("--steps", "4", "--checkpoint-dir", ""))  # alongside the parallel runs
    (tmp_path / "crash.py").write_text(CRASH_IN_SECOND_SAVE)
    crash = [*torchrun(2, *SHARDED, "--steps", "4", "--save-every", "2", "--checkpoint-dir", str(ckpt))]
    crash[crash.index(SCRIPT)] = str(tmp_path / "crash.py")
    rc, first, err = finish(start(crash))
    assert rc != 0 and "saved " + str(ckpt / "step-000002") in first and "step-000004" not in first, first + err
    assert re.search(r"^\S+ +linear +.*S\d", first, re.M), "the plan shards no linear"
    assert "tokens/s" in first and "peak RSS MiB per rank" in first
    # The crash left a partial step-000004.tmp; `latest` still names the complete step 2.
    assert (ckpt / "latest").read_text().strip() == "step-000002"
    assert not (ckpt / "step-000004").exists() and (ckpt / "step-000004.tmp").is_dir()
    shutil.copytree(ckpt, other)
    shutil.copytree(ckpt, piped)
    pipe = start(torchrun(2, "--mesh", "pipe=2", "--steps", "4", "--checkpoint-dir", str(piped), "--resume"))
    same = start(torchrun(2, *SHARDED, "--steps", "4", "--checkpoint-dir", str(ckpt), "--resume"))
    rc, resharded, err = finish(start(torchrun(2, "--mesh", "domain=2", "--steps", "4", "--checkpoint-dir",
                                               str(other), "--resume")))
    assert rc == 0, resharded + err
    rc, resumed, err = finish(same)
    assert rc == 0, resumed + err
    rc, pipelined, err = finish(pipe)
    assert rc == 0, pipelined + err
    assert "pipe: 2 stages on 2 ranks" in pipelined and sorted(losses(pipelined)) == [3, 4], pipelined
    assert "resuming after step 2" in resumed and "resuming after step 2" in resharded
    assert (ckpt / "latest").read_text().strip() == "step-000004" and not (ckpt / "step-000004.tmp").exists()
    rc, out, err = finish(single)
    assert rc == 0, out + err
    reference, crashed = losses(out), losses(first)
    assert sorted(reference) == sorted(crashed) == [1, 2, 3, 4] and sorted(losses(resumed)) == [3, 4]
    assert all(math.isfinite(v) for v in crashed.values())
    assert reference[4] < reference[1]  # it learns
    assert losses(resumed) == {3: crashed[3], 4: crashed[4]}  # the same mesh: bitwise (as printed)
    # Another mesh sums in another order: printed to 6 decimals, 2e-6 is 4 units of fp32 roundoff
    # (2**-21 = 4.8e-7 at a loss between 4 and 8), one of them the printing.
    for run in (crashed, losses(resharded), losses(pipelined)):
        for step, loss in run.items():
            assert loss == pytest.approx(reference[step], abs=2e-6), (step, run, reference)


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
        "--save-every -1: give a number of steps, or 0 to save only at the end": ["--save-every", "-1"],
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
