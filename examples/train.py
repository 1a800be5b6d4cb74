"""Train a Hugging Face causal LM with autojigsaw, under torchrun, on GPUs or CPUs.

    torchrun --standalone --nproc-per-node 4 examples/train.py                 # small Llama, 2 x 2 mesh
    torchrun --standalone --nproc-per-node 4 examples/train.py --model gpt2 --mesh data=2,tensor=2 \\
        --data tokens.npy --steps 100 --compile
    torchrun --standalone --nproc-per-node 4 examples/train.py --mesh pipe=2,tensor=2   # pipeline stages
    torchrun --standalone --nproc-per-node 4 examples/train.py --resume --steps 200    # go on

The model is built from a config (no download) with the same seed on every rank, so any mesh
starts from the same weights and reads the same batches: the losses match a 1-rank run. Rank 0
prints the plan and a line per step; a checkpoint (model + optimizer, torch.distributed.checkpoint)
is saved at the end under --checkpoint-dir (a crash mid-save keeps the previous one), and --resume
continues from the latest one, on the same mesh or another. One loop serves every mesh:
`pmodel.train_step` runs the step's forward and backward (over a pipe axis, every microbatch under
the plan's schedule) and returns the loss.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import shutil
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import autojigsaw
from autojigsaw.training import RECOMPUTE_CHOICES

MODELS = ("llama", "gpt2")
AXES = ("data", "domain", "tensor")  # "2x2" names the last two, "2x2x2" all three
TOKEN_DTYPES = ("uint16", "uint32", "int32", "int64")
# the optimizer's state keyed by parameter name: over a pipe axis each rank's optimizer holds other parameters
BY_NAME = StateDictOptions(flatten_optimizer_state_dict=True)
BAD_INPUT_GRACE_S = 30  # how long other ranks wait, after bad input, for local rank 0 to print and exit
transformers.logging.set_verbosity_error()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama", help=f"model family: {', '.join(MODELS)}")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256, help="hidden size (heads of 64)")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary size (above every token id of --data)")
    p.add_argument("--mesh", default="2x2", help="4 (tensor), 2x2 (domain x tensor), 2x2x2 (data x domain x "
                   "tensor) or named: data=2,tensor=2, pipe=2,tensor=2; the product must be the number of ranks")
    p.add_argument("--batch", type=int, default=8, help="sequences per step, over all ranks")
    p.add_argument("--microbatches", type=int, default=None, help="microbatches per step (default: the planner's "
                   "choice over a pipe axis, else 1; without a pipe axis: gradient accumulation)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=3, help="train up to this step (counted from the start "
                   "of the first run when resuming)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--memory-budget", type=float, default=None,
                   help="MiB per rank the plan may use (default: the device's memory)")
    p.add_argument("--compile", action="store_true", help="torch.compile the sharded graph")
    p.add_argument("--mp", choices=("bf16",), default=None,
                   help="mixed precision: bf16 compute, fp32 master weights and gradient sums")
    p.add_argument("--recompute", choices=RECOMPUTE_CHOICES, default="auto",
                   help="activation recomputation ('auto': the planner chooses per layer under the budget)")
    p.add_argument("--data", type=Path, help="token ids: a .npy of integers, or a raw .bin read as "
                   "--data-dtype (synthetic tokens without it)")
    p.add_argument("--data-dtype", default="uint16", choices=TOKEN_DTYPES, help="dtype of a raw .bin file")
    p.add_argument("--checkpoint-dir", type=lambda s: Path(s) if s else None, default=Path("checkpoints"),
                   help="where checkpoints go ('' for none); use one all nodes share")
    p.add_argument("--save-every", type=int, default=0, help="also save a checkpoint every N steps (0: only "
                   "at the end); a run killed mid-way then resumes from the last one")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    return p.parse_args(argv)


class BadInput(ValueError):
    """A mistake in the command line: printed as one line, exit status 2."""


def parse_mesh(text: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """'4', '2x2', '2x2x2' or 'data=2,tensor=2' -> (sizes, axis names)."""
    try:
        if "=" in text:
            pairs = [item.split("=") for item in text.split(",")]
            names, sizes = tuple(n.strip() for n, _ in pairs), tuple(int(s) for _, s in pairs)
        else:
            sizes = tuple(int(s) for s in text.lower().split("x"))
            names = AXES[len(AXES) - len(sizes):] if len(sizes) <= len(AXES) else ()
    except ValueError:
        sizes, names = (), ()
    if not sizes or len(names) != len(sizes) or min(sizes) < 1 or len(set(names)) != len(names):
        raise BadInput(f"--mesh {text!r} is not a mesh: write 4, 2x2, 2x2x2 or data=2,tensor=2")
    return sizes, names


def check_args(args, world: int) -> tuple[tuple[int, ...], tuple[str, ...], np.ndarray | None]:
    """Every check that needs no process group, before init_process_group: mesh sizes and axis
    names, and the tokens of --data (None for synthetic ones)."""
    for name in ("layers", "hidden", "vocab", "batch", "seq", "steps"):
        if getattr(args, name) < 1:
            raise BadInput(f"--{name} {getattr(args, name)}: give a positive number")
    if args.model not in MODELS:
        raise BadInput(f"unknown --model {args.model!r}: choose one of {', '.join(MODELS)}")
    sizes, names = parse_mesh(args.mesh)
    if math.prod(sizes) != world:
        raise BadInput(f"--mesh {args.mesh} has {math.prod(sizes)} ranks but {world} were started: "
                       f"give a mesh of {world} ranks, or start {math.prod(sizes)} (torchrun --nproc-per-node, --nnodes)")
    if args.save_every < 0:
        raise BadInput(f"--save-every {args.save_every}: give a number of steps, or 0 to save only at the end")
    if args.resume and args.checkpoint_dir is None:
        raise BadInput("--resume needs the --checkpoint-dir of the run to continue")
    if args.resume and latest_checkpoint(args.checkpoint_dir) is None:
        raise BadInput(f"--resume: no checkpoint in {args.checkpoint_dir}/ (no 'latest' file): train once "
                       "without --resume to make one, or point --checkpoint-dir at the run to continue")
    return sizes, names, (None if args.data is None else open_tokens(args))


def open_tokens(args) -> np.ndarray:
    """The token file as a read-only memmap of integer ids, checked against the vocabulary."""
    path = args.data
    if not path.is_file():
        raise BadInput(f"--data {path}: no such file; give a .npy or raw .bin file of token ids")
    if path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r")
        if tokens.dtype.kind not in "iu":
            raise BadInput(f"--data {path} holds {tokens.dtype}, not token ids: save integer ids "
                           "(np.save(path, ids.astype(np.uint16)))")
        tokens = tokens.reshape(-1)
    else:
        itemsize = np.dtype(args.data_dtype).itemsize
        if path.stat().st_size % itemsize:
            raise BadInput(f"--data {path}: {path.stat().st_size} bytes is not a whole number of "
                           f"{args.data_dtype} ids; give the --data-dtype it was written with")
        tokens = np.memmap(path, dtype=args.data_dtype, mode="r")
    if len(tokens) <= args.seq:
        raise BadInput(f"--data {path} has {len(tokens)} tokens, fewer than one sequence of "
                       f"--seq {args.seq} + 1: give more data or a shorter --seq")
    check_ids(int(tokens[:1 << 20].max()), args)
    return tokens


def check_ids(top: int, args) -> None:
    """Token ids must index the embedding; a wrong --data-dtype shows as ids far past any vocabulary."""
    if top >= 1 << 24:
        raise BadInput(f"--data {args.data} has token id {top}: give the --data-dtype it was written with")
    if top >= args.vocab:
        raise BadInput(f"--data {args.data} has token id {top}, outside --vocab {args.vocab}: give "
                       f"--vocab {top + 1} or more")


def latest_checkpoint(folder: Path) -> Path | None:
    """The checkpoint the `latest` file names, if both exist."""
    pointer = folder / "latest"
    if not pointer.is_file():
        return None
    path = folder / pointer.read_text().strip()
    return path if (path / ".metadata").is_file() else None


def build_model(args, device: torch.device) -> torch.nn.Module:
    """The model from a config, seeded: the same weights on every rank and every mesh."""
    heads = max(args.hidden // 64, 1)
    if args.model == "llama":
        config = transformers.LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.hidden,
                                          intermediate_size=4 * args.hidden, num_attention_heads=heads,
                                          num_key_value_heads=heads, vocab_size=args.vocab,
                                          max_position_embeddings=max(args.seq, 2048), use_cache=False)
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=heads,
                                         vocab_size=args.vocab, n_positions=max(args.seq, 1024),
                                         use_cache=False, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0)
        cls = transformers.GPT2LMHeadModel
    torch.manual_seed(args.seed)  # built on the CPU, whose random stream is the same everywhere
    return cls(config).to(device, getattr(torch, args.dtype))


def batch_at(step: int, args, tokens: np.ndarray | None, device) -> torch.Tensor:
    """The batch of `step`: the same on every rank and every mesh, whatever ran before."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    if tokens is None:  # count up from a random token among the first 256: learnable, the loss falls
        period = min(args.vocab, 256)
        ids = (torch.randint(0, period, (args.batch, 1), generator=gen) + torch.arange(args.seq)) % period
    else:
        starts = torch.randint(0, len(tokens) - args.seq, (args.batch,), generator=gen).tolist()
        ids = torch.from_numpy(np.stack([tokens[s:s + args.seq] for s in starts]).astype(np.int64))
        check_ids(int(ids.max()), args)
    return ids.to(device)


def peak_bytes(device: torch.device) -> int:
    """CUDA's peak allocated bytes, or on CPU this process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def save(folder: Path, step: int, pmodel, opt) -> Path:
    """Write the checkpoint to `step-N.tmp`, rename it to `step-N`, then point `latest` at it by
    another rename: a crash at any moment leaves `latest` naming the last complete checkpoint."""
    name = [f"step-{step:06d}"]
    if dist.get_rank() == 0:
        tries = (f"{name[0]}-{n}" for n in range(1, 1000))
        while (folder / name[0]).exists():
            name[0] = next(tries)
        shutil.rmtree(folder / f"{name[0]}.tmp", ignore_errors=True)  # left by a save that crashed
    dist.broadcast_object_list(name, src=0)
    path, partial = folder / name[0], folder / f"{name[0]}.tmp"
    state = {"model": pmodel.state_dict(), "optim": get_optimizer_state_dict(pmodel, opt, options=BY_NAME),
             "step": step}
    dcp.save(state, checkpoint_id=partial)
    dist.barrier()  # every rank's files are written
    if dist.get_rank() == 0:
        os.replace(partial, path)
        (folder / "latest.tmp").write_text(name[0] + "\n")
        os.replace(folder / "latest.tmp", folder / "latest")
    dist.barrier()
    return path


def load(folder: Path, pmodel, opt) -> int:
    """Load the latest checkpoint into the model and optimizer; the step it was saved at."""
    state = {"model": pmodel.state_dict(), "optim": get_optimizer_state_dict(pmodel, opt, options=BY_NAME), "step": 0}
    path = latest_checkpoint(folder)
    try:
        dcp.load(state, checkpoint_id=path)
    except CheckpointException as err:  # every rank raises it: the checkpoint is another model's
        cause, _traceback = next(iter(err.failures.values()))
        raise BadInput(f"--resume: {path} does not fit this model ({cause}): give the --model, --layers, "
                       "--hidden, --vocab and --dtype it was saved with") from err
    set_optimizer_state_dict(pmodel, opt, state["optim"], options=BY_NAME)
    return state["step"]


def train(args, sizes, names, tokens) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    mesh = init_device_mesh(device.type, sizes, mesh_dim_names=names)
    ids = batch_at(0, args, tokens, device)
    budget = None if args.memory_budget is None else int(args.memory_budget * 2**20)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.mp else None
    model = build_model(args, device)
    params = sum(p.numel() for p in model.parameters())  # over a pipe axis a rank holds only its stages'
    pmodel = autojigsaw.parallelize(model, mesh, (ids,), example_kwargs={"labels": ids},
                                    compile=args.compile, memory_budget=budget, mp_policy=mp,
                                    activation_checkpointing=args.recompute, microbatches=args.microbatches)
    opt = torch.optim.AdamW(pmodel.parameters(), lr=args.lr)
    start = load(args.checkpoint_dir, pmodel, opt) if args.resume else 0
    if start >= args.steps:
        raise BadInput(f"--resume: the checkpoint is at step {start}, --steps is {args.steps}: give more "
                       "--steps to go on")
    if rank == 0:
        print(pmodel.plan, flush=True)
        print(f"\n{args.model}, {params / 1e6:.2f} M parameters, "
              f"batch {args.batch} x {args.seq} tokens, {world} rank(s) on {device.type}"
              + (f", resuming after step {start}" if start else ""), flush=True)
    peaks = torch.zeros(world, dtype=torch.float64, device=device)
    for step in range(start + 1, args.steps + 1):
        t0 = time.perf_counter()
        ids = batch_at(step - 1, args, tokens, device)
        loss = pmodel.train_step(ids, labels=ids)  # forward and backward of every microbatch
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.item()  # waits for the step
        dt = time.perf_counter() - t0
        if not math.isfinite(loss):
            raise FloatingPointError(f"step {step}: the loss is {loss}; lower --lr")
        dist.all_gather_single(peaks, torch.tensor([peak_bytes(device)], dtype=torch.float64, device=device))
        if rank == 0:
            memory = " ".join(f"{b / 2**20:.0f}" for b in peaks.tolist())
            label = "max allocated" if device.type == "cuda" else "peak RSS"
            print(f"step {step:5d}  loss {loss:.6f}  {args.batch * args.seq / dt:9.0f} tokens/s  "
                  f"{label} MiB per rank: {memory}", flush=True)
        if args.checkpoint_dir and (step == args.steps or args.save_every and step % args.save_every == 0):
            path = save(args.checkpoint_dir, step, pmodel, opt)
            if rank == 0:
                print(f"saved {path}", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        sizes, names, tokens = check_args(args, int(os.environ.get("WORLD_SIZE", 1)))
    except BadInput as err:
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:  # one line per node
            print(f"train.py: error: {err}", file=sys.stderr, flush=True)
        else:  # torchrun stops every rank when one exits: let local rank 0 say why first
            time.sleep(BAD_INPUT_GRACE_S)
        return 2
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # A collective that never completes (a rank died) raises after the timeout instead of hanging.
    group = dict(backend="nccl" if cuda else "gloo", timeout=timedelta(minutes=10))
    if "RANK" not in os.environ:  # plain `python train.py`: one rank, no launcher
        group.update(store=dist.HashStore(), rank=0, world_size=1)
    dist.init_process_group(**group)
    try:
        train(args, sizes, names, tokens)
    except (ValueError, FloatingPointError) as err:  # the same on every rank: no plan fits, the loss diverged
        if dist.get_rank() == 0:
            print(f"train.py: error: {err}", file=sys.stderr, flush=True)
        return 2
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
