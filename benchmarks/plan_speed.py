"""How fast autojigsaw plans: a Llama-3-8B shape on an 8 x 8 mesh, then plan time against layers and mesh size.

Run: python benchmarks/plan_speed.py [--hf] [--quick] [--breakdown-only]

The model lives on the meta device. By default it is a hand-written Llama (RMSNorm, rotary
embeddings, grouped-query attention through scaled_dot_product_attention, SwiGLU) that
returns its training loss, the same shapes and ops as Hugging Face's; --hf builds
transformers' LlamaForCausalLM from a LlamaConfig instead (it returns the logits, and its
export traces more Python: masks, cache handling). Times are wall
seconds and, in brackets, this process's CPU seconds: the machine may be shared, and CPU
time is what the planner itself costs.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn

from autojigsaw import Options
from autojigsaw.api import plan_captured
from autojigsaw.capture import capture
from autojigsaw.mesh import MeshSpec

LLAMA_3_8B = dict(hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256)
BATCH, SEQ = 8, 2048


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _rotate(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d // heads
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(d, d, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + _rotate(q) * sin, k * cos + _rotate(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, ffn: int):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(d), Attention(d, heads, kv_heads)
        self.mlp_norm = RMSNorm(d)
        self.gate, self.up = nn.Linear(d, ffn, bias=False), nn.Linear(d, ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """Llama 3 without the cache: embedding, `layers` blocks, norm, head, and the training loss."""

    def __init__(self, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads, kv_heads, ffn) for _ in range(layers))
        self.norm, self.head = RMSNorm(hidden), nn.Linear(hidden, vocab, bias=False)
        head_dim = hidden // heads
        inv_freq = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, ids, labels):
        freqs = torch.outer(torch.arange(ids.shape[1], device=ids.device, dtype=torch.float32), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def llama(layers: int, hf: bool) -> nn.Module:
    with torch.device("meta"):
        if not hf:
            return Llama(layers, **LLAMA_3_8B)
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                          num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                          max_position_embeddings=8192, rope_theta=500000.0, use_cache=False)
        return LlamaForCausalLM(cfg)


class Clock:
    """Wall and CPU seconds since it started."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def read(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


def _s(wall: float, cpu: float | None = None) -> str:
    return f"{wall:.2f}" + (f" [{cpu:.2f}]" if cpu is not None else "")


def timed_plan(layers: int, mesh: dict[str, int], *, hf: bool = False, captured=None):
    """(plan, capture (wall, cpu), total (wall, cpu)) of one planning run."""
    clock = Clock()
    if captured is None:
        ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
        # transformers' model returns its logits (and a loss with labels=); ours returns the loss
        captured = capture(llama(layers, hf), (ids,) if hf else (ids, ids), {"use_cache": False} if hf else {})
    captured_at = clock.read()
    plan = plan_captured(captured, MeshSpec.of(mesh), Options(device="h100", training=True, memory_budget=None))
    return plan, captured_at, clock.read(), captured


def breakdown(hf: bool) -> None:
    plan, cap, total, _ = timed_plan(32, {"domain": 8, "tensor": 8}, hf=hf)
    s = plan.stats
    rows = [("capture (torch.export + decompositions)", _s(*cap)), ("strategies", _s(s.strategies_s)),
            ("costs and problem", _s(s.problem_s)), ("solve", _s(s.solve_s)),
            ("plan assembly and exact traffic", _s(s.traffic_s)), ("total", _s(*total))]
    print(f"\nLlama-3-8B shape ({'transformers' if hf else 'hand-written'}), 32 layers, batch {BATCH} x "
          f"seq {SEQ}, on domain=8 x tensor=8, h100, training:")
    print(tabulate(rows, headers=["stage", "seconds [cpu]"], tablefmt="simple"))
    print(s)
    print(f"predicted step {plan.step_time * 1e3:.1f} ms, comm {plan.comm_bytes / 2**30:.2f} GiB/rank, "
          f"peak {plan.memory_per_rank / 2**30:.1f} GiB/rank at the {plan.peak_at}")


def by_layers(counts: list[int]) -> None:
    rows = []
    for n in counts:
        plan, cap, total, _ = timed_plan(n, {"domain": 8, "tensor": 8})
        s = plan.stats
        rows.append((n, s.nodes, s.groups, s.strategies, _s(*cap), _s(s.strategies_s), _s(s.problem_s),
                     _s(s.solve_s), _s(s.traffic_s), _s(*total)))
    print("\nplan time against layers (hand-written Llama-3-8B shape, domain=8 x tensor=8):")
    print(tabulate(rows, headers=["layers", "nodes", "groups", "binaries", "capture", "strategies", "costs",
                                  "solve", "traffic", "total"], tablefmt="simple"))


def by_mesh(shapes: list[tuple[int, int]], layers: int) -> None:
    rows, captured = [], None
    for d, t in shapes:
        plan, _, total, captured = timed_plan(layers, {"domain": d, "tensor": t}, captured=captured)
        s = plan.stats
        rows.append((d * t, f"{d} x {t}", s.groups, s.strategies, _s(s.strategies_s), _s(s.problem_s),
                     _s(s.solve_s), _s(s.traffic_s), f"{plan.step_time * 1e3:.1f} ms"))
    print(f"\nplan time against mesh size ({layers} layers, capture excluded):")
    print(tabulate(rows, headers=["ranks", "domain x tensor", "groups", "binaries", "strategies", "costs",
                                  "solve", "traffic", "predicted step"], tablefmt="simple"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", action="store_true", help="also time transformers' LlamaForCausalLM")
    parser.add_argument("--quick", action="store_true", help="fewer layer counts and meshes")
    parser.add_argument("--breakdown-only", action="store_true",
                        help="only the Llama-3-8B shape on 8 x 8, stage by stage")
    args = parser.parse_args()
    breakdown(hf=False)
    if args.hf:
        breakdown(hf=True)
    if args.breakdown_only:
        return
    by_layers([1, 4, 16] if args.quick else [1, 2, 4, 8, 16, 32, 64, 128])
    by_mesh([(1, 2), (8, 8), (64, 64)] if args.quick else
            [(1, 2), (2, 2), (4, 4), (8, 8), (16, 16), (32, 32), (64, 64)], layers=8)


if __name__ == "__main__":
    main()
