"""Attention modules, plans forced to one attention layout, and workers comparing with one device."""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autojigsaw
from autojigsaw import Options
from autojigsaw.api import plan_captured, with_traffic
from autojigsaw.capture import capture
from autojigsaw.ir import STRATEGIES
from autojigsaw.kernels.collectives import count_comm
from autojigsaw.mesh import MeshSpec
from autojigsaw.placements import format_placements, replicated
from autojigsaw.rewrite.traffic import traffic_by_origin
from autojigsaw.testing.local_ranks import get_mesh

SDPA = "aten.scaled_dot_product_attention"


class Attention(nn.Module):
    """F.scaled_dot_product_attention alone, its mask an input."""

    def __init__(self, causal: bool = False, gqa: bool = False):
        super().__init__()
        self.causal, self.gqa = causal, gqa

    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal,
                                              enable_gqa=self.gqa)


def forced_plan(model, inputs, mesh: MeshSpec, pick: dict, *, input_placements=None):
    """The planner's plan with the strategy of some nodes replaced.

    `pick`: node name or op name as the plan says it ("aten.matmul") -> (kernel, output
    placements as text) of the strategy to force;
    `input_placements`: of the inputs (default: whole on every rank).
    """
    captured = capture(model, tuple(inputs))
    placements = input_placements or [replicated(mesh.ndim)] * len(captured.inputs)
    plan = plan_captured(captured, mesh, Options(device="cpu", training=True, memory_budget=None,
                                                 input_placements=placements))
    nodes = {n.name: n for n in captured.gm.graph.nodes}
    forced = []
    for ns in plan.nodes:
        node = nodes[ns.name]
        wanted = pick.get(ns.name) or pick.get(ns.op)
        if wanted:
            kernel, out = wanted
            found = [s for s in node.meta[STRATEGIES]
                     if s.kernel == kernel and format_placements(s.output) == out]
            assert found, (ns.name, wanted, [(s.kernel, format_placements(s.output))
                                             for s in node.meta[STRATEGIES]])
            s = found[0]
            ns = replace(ns, inputs=s.inputs, outputs=s.outputs, kernel=s.kernel, note=s.note)
        forced.append(ns)
    return with_traffic(replace(plan, nodes=tuple(forced)), captured)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference, relative to the reference's largest entry where that exceeds 1."""
    return (a - b).abs().max().item() / max(1.0, b.abs().max().item()) if a.numel() else 0.0


def _inputs(seq_len, dtype, mask_kind, heads, kv_heads, batch=2, dim=8):
    """q, k, v [B, H, S, D] (k, v with kv_heads) and a mask of the given kind, seeded."""
    gen = torch.Generator().manual_seed(seq_len * 7 + kv_heads)
    q = torch.randn(batch, heads, seq_len, dim, generator=gen, dtype=dtype)
    k, v = (torch.randn(batch, kv_heads, seq_len, dim, generator=gen, dtype=dtype) for _ in range(2))
    if mask_kind == "padding":  # bool [B, 1, 1, S]: batch 0 ignores its last 3 keys
        keep = torch.arange(seq_len)[None, :] < torch.tensor([seq_len - 3, seq_len])[:, None]
        return q, k, v, keep[:, None, None, :]
    if mask_kind == "bool":  # bool [B, 1, S, S], query row 1 sees no key at all
        keep = torch.rand(batch, 1, seq_len, seq_len, generator=gen) > 0.4
        keep[:, :, 1] = False
        return q, k, v, keep
    if mask_kind == "float":  # a learnable bias [H, S, S] with -inf holes
        bias = torch.randn(heads, seq_len, seq_len, generator=gen, dtype=dtype)
        bias[1, 2, ::3] = float("-inf")
        return q, k, v, bias
    if mask_kind == "float_rows":  # a learnable bias broadcast over query rows [B, 1, 1, S]
        return q, k, v, torch.randn(batch, 1, 1, seq_len, generator=gen, dtype=dtype)
    return q, k, v


def attention_case(pick, mesh_shape, names, seq_len, dtype, causal, mask_kind, kv_heads, heads=4):
    """Forced layout vs one device: output, dQ, dK, dV (and dMask), and bytes sent vs predicted."""
    mesh = get_mesh(mesh_shape, names)
    model = Attention(causal, gqa=kv_heads != heads)
    inputs = _inputs(seq_len, dtype, mask_kind, heads, kv_heads)
    plan = forced_plan(model, inputs, MeshSpec.of(mesh), {SDPA: pick})
    pmodel = autojigsaw.parallelize(model, mesh, inputs, plan=plan, compile=False)
    mine = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    ref = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    dout = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(5), dtype=dtype)
    with count_comm() as log:
        out = pmodel(*mine)
        out.backward(dout)
    expected = model(*ref)
    expected.backward(dout)
    errors = {"out": _err(out, expected)}
    for name, a, b in zip(("dq", "dk", "dv", "dmask"), mine, ref):
        if b.requires_grad:
            errors[name] = _err(a.grad, b.grad)
    sources = {name for name, t in zip(pmodel.program.captured.inputs, mine) if t.requires_grad}
    predicted = traffic_by_origin(pmodel.program.graph, pmodel.program.rank, sources, True)
    node = next(n for n in plan.nodes if n.op == SDPA)
    return errors, log.total_bytes, sum(predicted.values()), node.kernel, dist.get_rank()


class GPTBlock(nn.Module):
    """Pre-norm causal self-attention (separate q, k, v projections, optional GQA) and an MLP."""

    def __init__(self, d: int = 32, heads: int = 4, kv_heads: int = 4, hidden: int = 64):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d // heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, kv_heads * self.head_dim)
        self.v = nn.Linear(d, kv_heads * self.head_dim)
        self.o = nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x):
        b, s, d = x.shape
        h = self.ln1(x)
        q = self.q(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class VisionAttention(nn.Module):
    """Attention written out, as vision and weather models do: q @ k^T * scale, softmax, @ v."""

    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.heads, self.scale = heads, (d // heads) ** -0.5
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1) * self.scale).softmax(dim=-1)
        return x + self.proj((attn @ v).transpose(1, 2).reshape(b, s, d))


class ViT(nn.Module):
    """A tiny Hugging Face ViTModel (SDPA attention, 17 tokens): its last hidden state."""

    def __init__(self):
        super().__init__()
        from transformers import ViTConfig, ViTModel

        cfg = ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                        image_size=16, patch_size=4, num_channels=3, attn_implementation="sdpa")
        self.vit = ViTModel(cfg, add_pooling_layer=False)

    def forward(self, pixels):
        return self.vit(pixel_values=pixels).last_hidden_state


class Unbind(nn.Module):
    """One linear, its output unbound into two items read by different layouts (as q, k, v are)."""

    def __init__(self, d: int = 4):
        super().__init__()
        self.lin, self.w = nn.Linear(d, d), nn.Parameter(torch.randn(d, d))

    def forward(self, x):
        a, b = self.lin(x).unbind(0)
        return a @ self.w, b


def build_model(name: str, dtype: torch.dtype, seq_len: int = 12):
    """(model, input) with seeded weights: "gpt" (GQA 4/2 heads), "gpt3" (3 heads), "vit", "vision",
    "unbind"."""
    torch.manual_seed(0)
    if name == "unbind":
        model, x = Unbind(), torch.randn(2, seq_len, 4)
    elif name == "vit":
        model, x = ViT(), torch.randn(2, 3, 16, 16)
    elif name == "gpt":
        model, x = GPTBlock(heads=4, kv_heads=2), torch.randn(2, seq_len, 32)
    elif name == "gpt3":
        model, x = GPTBlock(d=24, heads=3, kv_heads=3), torch.randn(2, seq_len, 24)
    else:
        model, x = VisionAttention(), torch.randn(2, seq_len, 32)
    return model.to(dtype), x.to(dtype)


def model_case(name, mesh_shape, names, pick, input_placements, dtype, steps: int = 2):
    """Train the parallel and the one-device model side by side: max differences, and the plan.

    SGD with momentum, not Adam: Adam turns the rounding noise of a gradient that is zero
    (a key bias: softmax ignores a shift shared by a row) into steps of size lr.
    """
    mesh = get_mesh(mesh_shape, names)
    ref, x = build_model(name, dtype)
    model = copy.deepcopy(ref)
    plan = forced_plan(model, (x,), MeshSpec.of(mesh), pick, input_placements=input_placements)
    pmodel = autojigsaw.parallelize(model, mesh, (x,), plan=plan, compile=False)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9) for m in (pmodel, ref))
    diffs = {"output": 0.0, "grad": 0.0, "param": 0.0}
    for step in range(steps):
        y, y_ref = pmodel(x), ref(x)
        y, y_ref = (torch.cat([t.flatten() for t in v]) if isinstance(v, tuple) else v for v in (y, y_ref))
        target = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(step), dtype=dtype)
        diffs["output"] = max(diffs["output"], _err(y, y_ref))
        (y * target).sum().backward()
        (y_ref * target).sum().backward()
        for p, q in zip(pmodel.parameters(), ref.parameters()):
            diffs["grad"] = max(diffs["grad"], _err(p.grad.full_tensor(), q.grad))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    for p, q in zip(pmodel.parameters(), ref.parameters()):
        diffs["param"] = max(diffs["param"], _err(p.full_tensor(), q))
    return diffs, plan.to_json() if dist.get_rank() == 0 else None


def compiled_case(pick, seq_len: int, kv_heads: int) -> dict:
    """The attention op compiled (fullgraph) in a forced layout: graph breaks and errors vs one device.

    The backend is aot_eager: it traces the forward and backward as inductor does but generates no
    kernels, whose C++ builds took most of this test's 2.3 minutes in CI (a cold cache).
    """
    from torch._dynamo.utils import counters

    counters.clear()
    mesh = get_mesh((dist.get_world_size(),), ("domain",))
    model = Attention(causal=True, gqa=kv_heads != 4)
    inputs = _inputs(seq_len, torch.float32, None, 4, kv_heads)
    plan = forced_plan(model, inputs, MeshSpec.of(mesh), {SDPA: pick})
    pmodel = autojigsaw.parallelize(model, mesh, inputs, plan=plan, compile="aot_eager")
    mine = [t.clone().requires_grad_() for t in inputs]
    ref = [t.clone().requires_grad_() for t in inputs]
    out, expected = pmodel(*mine), model(*ref)
    out.sum().backward()
    expected.sum().backward()
    errors = {"out": _err(out, expected)} | {k: _err(a.grad, b.grad) for k, a, b in zip("qkv", mine, ref)}
    return {"breaks": sum(counters["graph_break"].values()), "graphs": counters["stats"]["unique_graphs"],
            "errors": errors}
