"""The default plan table's cells in short (ops, placements, kernels) and its lines cut to fit a terminal."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence

from tabulate import tabulate

from .modules import ELLIPSIS, cut_middle, layer_of
from .placements import Placements, compact_placements, format_placements

TABLE_WIDTH = 120  # characters in a line of the default table: a terminal's
MODULE_WIDTH = 28  # module paths longer than this are cut in the middle (modules.short_paths)
NARROWEST_CELL = 12  # an op, placements or kernel cell cut to fit TABLE_WIDTH keeps this many characters
HEADERS = ("module", "op", "placements", "kernel", "comm/rank", "time")
_BUILTIN = re.compile(r"<built-in function (\w+)>")
SHORT_OPS = {"scaled_dot_product_attention": "sdpa", "_scaled_dot_product_flash_attention": "sdpa_flash",
             "_scaled_dot_product_efficient_attention": "sdpa_efficient",
             "_scaled_dot_product_cudnn_attention": "sdpa_cudnn", "cross_entropy_loss": "cross_entropy"}


def short_op(op: str) -> str:
    """"linear" for aten.linear, "add" for aten.add.Tensor, "sdpa" for aten.scaled_dot_product_attention,
    "getitem" for <built-in function getitem>."""
    name = op.split(".")[1] if op.startswith("aten.") else op.removesuffix(".default")
    return SHORT_OPS.get(name, _BUILTIN.sub(r"\1", name))


def placements_cell(inputs: Sequence[Placements], output: Placements | None) -> str:
    """"S0R RS0 -> S0S2": each input's placements, then the output's."""
    text = " ".join(compact_placements(p) for p in inputs)
    return f"{text} -> {compact_placements(output)}" if output else text


def kernel_cell(kernel: str, fallback: bool) -> str:
    """The kernel's name; "fallback" for an op run whole for want of a sharding rule."""
    if not fallback:
        return kernel
    return "fallback" if kernel == "local" else f"{kernel} (fallback)"


def narrow_table(rows: list[tuple[str, ...]]) -> str:
    """`rows` under HEADERS, the op, placements and kernel cells cut in the middle (the widest column's
    first) until a line fits TABLE_WIDTH."""
    shrink = (1, 2, 3)
    # tabulate's simple format: two spaces between columns, headers padded by two
    widths = [max([len(h) + 2] + [len(r[c]) for r in rows]) for c, h in enumerate(HEADERS)]
    while sum(widths) + 2 * (len(widths) - 1) > TABLE_WIDTH:
        column = max(shrink, key=widths.__getitem__)
        if widths[column] <= NARROWEST_CELL:
            break
        widths[column] -= 1
    cut = [tuple(cut_middle(cell, widths[c]) if c in shrink else cell for c, cell in enumerate(r)) for r in rows]
    return tabulate(cut, headers=HEADERS, tablefmt="simple", disable_numparse=True,
                    colalign=("left",) * 4 + ("right",) * 2)


def legend(axis_names: Sequence[str], *, fsdp: bool) -> str:
    """What the default table's cells mean, a line per subject."""
    first, *others = axis_names
    rest = "" if not others else f", whole over {others[0] if len(others) == 1 else 'the others'}"
    example = f"S0{'R' * len(others)}: dim 0 split over {first}{rest}"
    return (f"placements: the op's inputs (linear: activation, weight, bias) -> output, a token per mesh axis "
            f"({', '.join(axis_names)})\n"
            f"  Sd = split along dim d, R = whole copy, P = partial sums to add; {example}\n"
            "kernel: local = the op on local shards, fallback = no sharding rule (run whole), others = "
            "autojigsaw's kernels\n"
            f"time = comm + compute; {{0..3}}: alike layers; {ELLIPSIS}: path cut short; "
            "table(wide=True): node names, shapes, memory, notes"
            + ("\n(FSDP): bytes of its gathers and reduce-scatters; time: what they add to the step beyond the "
               "rows above (what compute does not hide)" if fsdp else ""))


def wrapped(text: str) -> str:
    """`text` with every line longer than TABLE_WIDTH broken after a comma or semicolon where it can, between
    words where it must, the lines it adds indented."""
    lines = []
    for line in text.splitlines():
        pieces = [""]
        for chunk in re.split(r"(?<=[,;]) ", line):
            if pieces[-1] and len(pieces[-1]) + 1 + len(chunk) > TABLE_WIDTH:
                pieces.append("  ")
            pieces[-1] += (" " if pieces[-1].strip() else "") + chunk
        lines += [part for piece in pieces for part in textwrap.wrap(
            piece, TABLE_WIDTH, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)]
    return "\n".join(lines)


def span_name(layers: Sequence[str]) -> str:
    """"model.layers.0 .. model.layers.3" for a stage's layers (the one name for one layer)."""
    return layers[0] if len(layers) == 1 else f"{layers[0]} .. {layers[-1].rsplit('.', 1)[-1]}"


def stages_table(stages) -> str:
    """A row per pipeline stage: its rank, layers, seconds per microbatch, bytes it sends, microbatches it
    holds, its rank's memory."""
    rows = [(str(st.index), str(st.rank), cut_middle(span_name(st.layers), 40), format_seconds(st.forward_s),
             format_seconds(st.backward_s), format_bytes(st.send_bytes), str(st.in_flight), format_bytes(st.plan.memory_per_rank))
            for st in stages]
    return tabulate(rows, headers=("stage", "rank", "layers", "forward", "backward", "sends", "in flight", "memory"),
                    tablefmt="simple", disable_numparse=True, colalign=("right", "right", "left") + ("right",) * 5)


def format_bytes(n: float | None) -> str:
    """Bytes in B, KiB, MiB, GiB or TiB."""
    if not n:
        return "0"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def format_seconds(s: float) -> str:
    """Seconds in us, ms or s."""
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def with_layer(module: str, index: str) -> str:
    """`module` with the index of its repeated layer replaced by `index` ("model.layers.{i}.mlp")."""
    found = layer_of(module)
    if found is None:
        return module
    prefix, i = found
    return f"{prefix}.{index}{module[len(prefix) + 1 + len(str(i)):]}"


def collapsed(nodes: list) -> list[list]:
    """Nodes grouped when they differ only by the layer they run in (`layers.3` vs `layers.4`)."""
    groups: dict[tuple, list] = {}
    for n in nodes:
        pattern = with_layer(n.module, "{i}") if n.module else n.name
        key = (pattern, n.op, n.shape, n.input_shapes, n.inputs, n.outputs, n.kernel, n.fallback, n.note)
        groups.setdefault(key, []).append(n)
    return list(groups.values())


def node_row(group: list, label: str | None = None) -> tuple:
    """One table row for nodes that run alike: their summed costs; `label` for a row of leftovers."""
    comm, comm_s = sum(n.comm_bytes for n in group), sum(n.comm_s for n in group)
    compute, memory = sum(n.compute_s for n in group), sum(n.memory_bytes for n in group)
    if label is not None:
        return ("", label, "", "", "", "", "", format_bytes(comm), format_seconds(comm_s), format_seconds(compute),
                format_bytes(memory), "")
    n, module, name = group[0], group_module(group), group_name(group)
    shapes = " ".join("x".join(map(str, s)) for s in n.input_shapes) + " -> " + "x".join(map(str, n.shape))
    return (module, name, n.op, shapes, " ".join(format_placements(p) for p in n.inputs),
            format_placements(n.output) if n.output else "", n.kernel + (" (fallback)" if n.fallback else ""),
            format_bytes(comm), format_seconds(comm_s), format_seconds(compute), format_bytes(memory), n.note)


def group_module(group: list) -> str:
    """The module of a row's nodes, with the range of their layers ("model.layers.{0..3}.mlp")."""
    indices = [found[1] for g in group if (found := layer_of(g.module))]
    if len(group) > 1 and len(indices) == len(group):
        return with_layer(group[0].module, f"{{{indices[0]}..{indices[-1]}}}")
    return group[0].module


def group_name(group: list) -> str:
    """The first node's name, and how many nodes the row holds ("linear_4 (x4)")."""
    return group[0].name + (f" (x{len(group)})" if len(group) > 1 else "")


def group_costs(group: list) -> tuple[str, str]:
    """Bytes sent per rank and seconds (comm + compute) of a row's nodes."""
    return format_bytes(sum(n.comm_bytes for n in group)), format_seconds(sum(n.comm_s + n.compute_s for n in group))
