"""What every benchmark shares: the machine line, tables printed and saved as markdown."""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path

import torch
from tabulate import tabulate

# AUTOJIGSAW_BENCH_OUT moves the output (the smoke test writes to a temporary folder).
OUT = Path(os.environ.get("AUTOJIGSAW_BENCH_OUT") or Path(__file__).resolve().parent / "out")


def machine() -> str:
    """Date, CPU, cores, load and torch version: where and when the numbers came from."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = ", load average %.1f" % os.getloadavg()[0] if hasattr(os, "getloadavg") else ""
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"{datetime.date.today().isoformat()}, {cpu}, {os.cpu_count()} cores{load}{gpu}, "
            f"torch {torch.__version__}")


class Report:
    """Sections of markdown tables: printed as they come, saved to benchmarks/out/<name>.md."""

    def __init__(self, name: str, title: str):
        self.name, self.lines = name, [f"## {title}", "", f"Measured on {machine()}.", ""]
        print(f"\n=== {title} ({machine()})")

    def table(self, caption: str, rows: list, headers: list[str], note: str = "") -> None:
        print(f"\n{caption}\n" + tabulate(rows, headers=headers, tablefmt="simple"))
        if note:
            print(note)
        self.lines += [f"**{caption}**", "", tabulate(rows, headers=headers, tablefmt="github"), ""]
        if note:
            self.lines += [note, ""]

    def text(self, caption: str, body: str) -> None:
        print(f"\n{caption}\n{body}")
        self.lines += [f"**{caption}**", "", "```", body, "```", ""]

    def save(self) -> Path:
        OUT.mkdir(parents=True, exist_ok=True)
        path = OUT / f"{self.name}.md"
        path.write_text("\n".join(self.lines))
        print(f"\n(saved {path})")
        return path


def kib(n: float) -> str:
    return f"{n / 1024:.1f}"


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"
