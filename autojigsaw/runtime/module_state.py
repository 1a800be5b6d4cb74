"""What of a model's modules torch.export bakes into a graph: the program cache must see it change.

A graph holds the train/eval mode (dropout, BatchNorm's batch statistics), every plain attribute
the code read (dropout's `p`, a temperature, a flag) and the hooks that ran while it was captured.
`model.drop.p = 0.0` after a program was built would otherwise keep running the old `p`, with
no error; torch.compile guards on the same things and recompiles.
"""

from __future__ import annotations

from torch import nn

PLAIN = (bool, int, float, str, type(None))
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def module_state(model: nn.Module) -> tuple:
    """Per module: its public plain attributes (`training` among them) and the keys of its hooks.
    Private ones are left out: FSDP and Hugging Face keep their flags there (`_is_fsdp_managed_module`)."""
    return tuple((tuple((k, v) for k, v in m.__dict__.items() if isinstance(v, PLAIN) and k[0] != "_"),
                  tuple(tuple(getattr(m, h)) for h in _HOOKS)) for m in model.modules())


def describe_modes(state: tuple) -> str:
    """The train/eval modes of a state, for the log."""
    modes = [dict(attrs)["training"] for attrs, _ in state]
    return "training mode" if all(modes) else "eval mode" if not any(modes) else "mixed train/eval modules"


def changed_state(model: nn.Module, before: tuple | None, after: tuple) -> str:
    """What differs between two states of `model` other than modes ("; drop.p 0.3 -> 0.0"), for the log."""
    if before is None or len(before) != len(after):
        return ""
    changes = []
    for (name, _), (attrs, hooks), (new_attrs, new_hooks) in zip(model.named_modules(), before, after):
        old, new = dict(attrs), dict(new_attrs)
        changes += [f"{name + '.' if name else ''}{k} {old.get(k)!r} -> {v!r}" for k, v in new.items()
                    if k != "training" and old.get(k) != v]
        if hooks != new_hooks:
            changes.append(f"hooks of {name or 'the model'}")
    return "; " + ", ".join(changes) if changes else ""
