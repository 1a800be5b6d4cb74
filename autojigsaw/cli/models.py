"""The model the command line plans, on the meta device: from a transformers config, a model type with
overrides, or a function of the user's that returns the model and its example inputs."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

# --layers, --hidden, ... -> the config field each sets (transformers maps them onto a model's own names)
OVERRIDES = {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
             "kv_heads": "num_key_value_heads", "ffn": "intermediate_size", "vocab": "vocab_size"}


@dataclass
class Workload:
    """A model and one step's inputs: `tokens` per step when the model reads token ids (else None)."""

    model: torch.nn.Module
    inputs: tuple
    kwargs: dict = field(default_factory=dict)
    tokens: int | None = None
    config: object = None  # the transformers config, when there is one


def from_args(args, global_batch: int) -> Workload:
    """The workload that --config, --hf or --model names, with `global_batch` sequences of --seq tokens."""
    if args.model:
        return from_function(args.model, global_batch, args.seq)
    return from_config(_config(args), global_batch, args.seq)


def _config(args):
    import transformers

    sets = dict(_setting(text) for text in args.set or ())
    sets.update({OVERRIDES[k]: v for k, v in vars(args).items() if k in OVERRIDES and v is not None})
    if args.config:
        path = Path(args.config)
        if not path.exists():
            raise ValueError(f"--config {args.config}: no such file; give a transformers config.json")
        config = transformers.AutoConfig.from_pretrained(str(path))
        for name, value in sets.items():
            setattr(config, name, value)
    else:
        config = transformers.AutoConfig.for_model(args.hf, **sets)
    config.use_cache = False
    return config


def _setting(text: str) -> tuple[str, object]:
    """"rope_theta=500000.0" -> ("rope_theta", 500000.0): the value as JSON where it parses, else the text."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise ValueError(f"--set {text!r}: give NAME=VALUE, e.g. --set rope_theta=500000.0")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def from_config(config, global_batch: int, seq: int | None) -> Workload:
    """A transformers model of `config` on the meta device, trained on token ids (the labels are the ids)."""
    import transformers

    if seq is None:
        raise ValueError("--seq: give the tokens per sequence (e.g. --seq 8192)")
    with torch.device("meta"):
        try:
            model, causal = transformers.AutoModelForCausalLM.from_config(config), True
        except ValueError:  # no causal LM of this type: the base model, without labels
            model, causal = transformers.AutoModel.from_config(config), False
        ids = torch.zeros(global_batch, seq, dtype=torch.long)
    return Workload(model, (ids,), {"labels": ids} if causal else {}, global_batch * seq, config)


def from_function(target: str, global_batch: int, seq: int | None) -> Workload:
    """`package.module:function`'s (model, example_inputs[, example_kwargs]), imported with the current directory
    on the path; it is given batch= and seq= where its signature takes them."""
    module_name, sep, name = target.partition(":")
    if not sep:
        raise ValueError(f"--model {target!r}: give package.module:function")
    if os.getcwd() not in sys.path:  # the current directory's modules, as `python -m` imports them
        sys.path.insert(0, os.getcwd())
    fn = getattr(importlib.import_module(module_name), name, None)
    if fn is None:
        raise ValueError(f"--model {target!r}: {module_name} has no {name!r}")
    params = inspect.signature(fn).parameters
    given = {k: v for k, v in (("batch", global_batch), ("seq", seq)) if k in params and v is not None}
    made = fn(**given)
    if not (isinstance(made, tuple) and len(made) in (2, 3) and isinstance(made[0], torch.nn.Module)):
        raise ValueError(f"--model {target!r} returned {type(made).__name__}: return (model, example_inputs) or "
                         "(model, example_inputs, example_kwargs)")
    inputs = made[1] if isinstance(made[1], tuple) else (made[1],)
    return Workload(made[0], inputs, dict(made[2]) if len(made) == 3 else {}, None, getattr(made[0], "config", None))
