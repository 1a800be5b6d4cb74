"""The command line's arguments, and the planning run they describe."""

from __future__ import annotations

import argparse
import re

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import autojigsaw
from autojigsaw.training import DATA_PARALLEL_CHOICES, RECOMPUTE_CHOICES

from .models import OVERRIDES
from .plot import INSTALL
from .runs import Run

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="autojigsaw", description="autojigsaw's command line")
    sub = top.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="plan a model on a mesh without any GPU: will it fit, how fast will it run",
                       description="Plan a model on a mesh on the meta device: the plan's table, then whether it "
                                   "fits and its predicted throughput. Exit status 0: it fits; 1: it does not "
                                   "(the smallest changes that fit are named); 2: a usage error.")
    model = p.add_argument_group("the model (one of --config, --hf, --model)")
    source = model.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="a transformers config.json")
    source.add_argument("--hf", metavar="TYPE", help="a transformers model type (llama, mistral, gpt2, ...), "
                                                     "built by AutoConfig.for_model with the overrides below")
    source.add_argument("--model", metavar="MODULE:FUNCTION",
                        help="a function returning (model, example_inputs[, example_kwargs]); given batch= and "
                             "seq= (the global batch) where its signature takes them")
    for flag, name in OVERRIDES.items():
        model.add_argument(f"--{flag.replace('_', '-')}", dest=flag, type=int, help=f"the config's {name}")
    model.add_argument("--set", action="append", metavar="NAME=VALUE", help="any other config field (repeatable)")
    run = p.add_argument_group("the run")
    run.add_argument("--batch", type=int, default=1, help="sequences per data-parallel replica and step "
                                                          "(with --gpus: per GPU); default 1")
    run.add_argument("--seq", type=int, help="tokens per sequence")
    where = run.add_mutually_exclusive_group(required=True)
    where.add_argument("--mesh", help="mesh axes and sizes, e.g. data=8,tensor=8 ('data'/'dp' split the batch)")
    where.add_argument("--gpus", type=int, help="the GPU count: the mesh is searched")
    run.add_argument("--gpus-per-node", type=int, help="GPUs per node, with --gpus")
    run.add_argument("--device", default="h100", help="the device spec: h100 (default), h100-96gb, h200, a100, "
                                                      "a100-40gb, cpu; '+compile' appended for a compiled step")
    run.add_argument("--mp", choices=sorted(_PRECISIONS), default="fp32",
                     help="compute precision: bf16 or fp16 with fp32 masters and gradient sums; fp32 (default)")
    run.add_argument("--recompute", choices=RECOMPUTE_CHOICES, default="none", help="activation checkpointing")
    run.add_argument("--budget", help="memory per GPU, e.g. 70GiB or 75GB (default: 90 %% of the device's)")
    run.add_argument("--optimizer", default="adam", help="whose state is priced: adam (default), adamw, sgd, ...")
    run.add_argument("--data-parallel", choices=DATA_PARALLEL_CHOICES, help="on the data axis: fsdp (default) "
                                                                            "or ddp")
    run.add_argument("--mip-gap", type=float, default=autojigsaw.Options.mip_gap,
                     help="stop the solve at this proven gap to the optimum (default 0.01; 0: prove optimality)")
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", help="write the plan as JSON (autojigsaw.Plan.from_json reads it)")
    out.add_argument("--plot", metavar="PATH", help="draw memory over the step by kind and where the time goes "
                                                   "(needs matplotlib: pip install 'autojigsaw[plot]')")
    out.add_argument("--wide", action="store_true", help="every column of the plan's table")
    return top


def run_of(args: argparse.Namespace) -> Run:
    """The Run the arguments describe; a ValueError names an argument that does not hold."""
    if args.plot:
        _check_matplotlib()
    if args.batch < 1:
        raise ValueError(f"--batch {args.batch}: give at least 1 sequence per replica")
    if args.gpus_per_node is not None and args.gpus is None:
        raise ValueError("--gpus-per-node goes with --gpus (a mesh given by --mesh says its own sizes)")
    dtype = _PRECISIONS[args.mp]
    options = {"device": args.device, "activation_checkpointing": args.recompute, "optimizer": args.optimizer,
               "mip_gap": args.mip_gap,
               "mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else None}
    if args.budget is not None:
        options["memory_budget"] = parse_bytes(args.budget)
    if args.data_parallel is not None:
        options["data_parallel"] = args.data_parallel
    autojigsaw.Options(**options)  # checks them before anything is built
    mesh = parse_mesh(args.mesh) if args.mesh else None
    return Run(args.batch, mesh, args.gpus, args.gpus_per_node, tuple(options.items()))


def _check_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(f"--plot draws with matplotlib, which is not installed: {INSTALL}") from None


def parse_bytes(text: str) -> int:
    """"70GiB", "75 GB", "1.5e9" -> bytes."""
    found = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    unit = found.group(2).lower() if found else None
    if not found or unit not in _UNITS:
        raise ValueError(f"--budget {text!r}: give bytes per GPU with a unit, e.g. 70GiB or 75GB")
    return int(float(found.group(1)) * _UNITS[unit])


def parse_mesh(text: str) -> tuple[tuple[str, int], ...]:
    """"data=8,tensor=8" -> (("data", 8), ("tensor", 8))."""
    axes = []
    for part in text.split(","):
        name, sep, size = part.strip().partition("=")
        if not sep or not name or not size.strip().isdigit() or int(size) < 1:
            raise ValueError(f"--mesh {text!r}: give axis=size pairs, e.g. data=8,tensor=8")
        axes.append((name.strip(), int(size)))
    if len({a for a, _ in axes}) != len(axes):
        raise ValueError(f"--mesh {text!r}: an axis is named twice")
    return tuple(axes)
