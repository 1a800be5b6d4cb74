"""A grammar of small models as plain data, its hypothesis strategies, and a deterministic builder.

A `ModelSpec` is a stem (token embedding, linear on features, or a conv2d patch embedding), a
residual stream of blocks (attention, MLP, token mixing, a softmax gate, a head-wise reshape)
and a head (a linear, or tied to the embedding). `build(spec)` seeds from the spec, so every
rank builds the same model and inputs. Sizes are odd on purpose (7, 13, 15): they do not divide
by the mesh.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

from .rope_llama import RMSNorm, apply_rotary, in_dtype, rope_frequencies

F64 = torch.float64


@dataclass(frozen=True)
class Attn:
    """Pre-norm attention with a residual: fused or separate q/k/v, GQA, RoPE, SDPA or written out."""

    heads: int
    kv_heads: int  # divides heads; < heads is GQA
    head_dim: int
    norm: str  # "layer" | "rms" | "batch" | "none"
    fused_qkv: bool
    bias: bool
    gqa: str  # "repeat" (repeat_interleave) | "sdpa" (enable_gqa)
    impl: str  # "sdpa" | "written" (q @ k^T, softmax, @ v)
    mask: str  # "none" | "causal" | "bool" (a buffer) | "additive" (a buffer) | "input" (a bool input)
    rope: bool  # complex RoPE on q and k: computes in fp32


@dataclass(frozen=True)
class MLP:
    """Pre-norm MLP with a residual; `gated`: act(w1 x) * w3 x, the Llama form."""

    hidden: int
    act: str  # "gelu" | "silu" | "relu" | "tanh"
    gated: bool
    norm: str
    bias: bool


@dataclass(frozen=True)
class TokenMix:
    """MLP-Mixer token mixing: transpose, a linear over the sequence, GELU, back, residual."""

    hidden: int


@dataclass(frozen=True)
class SoftmaxGate:
    """x * softmax(linear(x) / t) over the features."""

    temperature: float


@dataclass(frozen=True)
class GroupLinear:
    """Reshape features into groups, permute, a linear inside each group, permute back, residual."""

    groups: int  # divides dim


@dataclass(frozen=True)
class SeqConv:
    """A conv1d along the sequence (ConvNeXt, Mamba): transpose, conv, SiLU, back, residual."""

    kernel: int  # odd: "same" padding
    depthwise: bool


@dataclass(frozen=True)
class MHA:
    """nn.MultiheadAttention (batch_first, one packed in_proj_weight), pre-norm, residual."""

    heads: int  # divides dim
    causal: bool
    bias: bool


Block = Attn | MLP | TokenMix | SoftmaxGate | GroupLinear | SeqConv | MHA


@dataclass(frozen=True)
class ModelSpec:
    """A whole model and its inputs: stem, blocks, final norm, head, sizes and seed."""

    stem: str  # "tokens" | "features" | "patches"
    batch: int
    seq: int
    dim: int
    in_dim: int  # features: input width; patches: channels; tokens: vocab
    blocks: tuple[Block, ...]
    final_norm: str
    head: str  # "linear" | "tied" (tokens only) | "none"
    out_dim: int
    seed: int
    positions: bool = False  # a learned position embedding indexed by arange
    repeat_first: bool = False  # the first block runs again at the end: one module, two uses (ALBERT)
    two_outputs: bool = False  # the model returns (head output, final stream)
    loss: bool = False  # the model returns cross_entropy(logits, tokens shifted by one) (tokens, linear/tied head)

    @property
    def unit(self) -> float:
        """Unit roundoff of the dtype the model computes in: fp32 inside complex RoPE, else fp64."""
        return 2.0**-24 if any(isinstance(b, Attn) and b.rope for b in self.blocks) else 2.0**-53


class SeqBatchNorm(nn.Module):
    """BatchNorm1d over the features of a (batch, seq, features) stream: statistics over batch and seq."""

    def __init__(self, dim: int):
        super().__init__()
        self.bn = nn.BatchNorm1d(dim)

    def forward(self, x):
        return self.bn(x.transpose(1, 2)).transpose(1, 2)


def _norm(kind: str, dim: int) -> nn.Module:
    return {"layer": lambda: nn.LayerNorm(dim), "rms": lambda: RMSNorm(dim), "batch": lambda: SeqBatchNorm(dim),
            "none": nn.Identity}[kind]()


ACTS = {"gelu": F.gelu, "silu": F.silu, "relu": F.relu, "tanh": torch.tanh}


class AttnBlock(nn.Module):
    def __init__(self, spec: Attn, dim: int, seq: int, gen: torch.Generator):
        super().__init__()
        self.s = spec
        h, kv, hd = spec.heads, spec.kv_heads, spec.head_dim
        self.norm = _norm(spec.norm, dim)
        if spec.fused_qkv:
            self.wqkv = nn.Linear(dim, (h + 2 * kv) * hd, bias=spec.bias)
        else:
            self.wq = nn.Linear(dim, h * hd, bias=spec.bias)
            self.wk = nn.Linear(dim, kv * hd, bias=spec.bias)
            self.wv = nn.Linear(dim, kv * hd, bias=spec.bias)
        self.wo = nn.Linear(h * hd, dim, bias=spec.bias)
        if spec.rope:
            self.register_buffer("freqs", rope_frequencies(hd, seq), persistent=False)
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        if spec.mask == "bool":
            self.register_buffer("mask", (torch.rand(seq, seq, generator=gen) < 0.6) | torch.eye(seq, dtype=torch.bool))
        elif spec.mask == "additive":
            self.register_buffer("mask", torch.randn(seq, seq, generator=gen, dtype=F64).masked_fill(~causal, -1e9))
        elif spec.mask == "causal" and spec.impl == "written":
            self.register_buffer("mask", causal)

    def forward(self, x, mask=None):
        s = self.s
        b, t, _ = x.shape
        h, kv, hd = s.heads, s.kv_heads, s.head_dim
        y = self.norm(x)
        if s.fused_qkv:
            q, k, v = self.wqkv(y).split([h * hd, kv * hd, kv * hd], dim=-1)
        else:
            q, k, v = self.wq(y), self.wk(y), self.wv(y)
        q, k, v = q.view(b, t, h, hd), k.view(b, t, kv, hd), v.view(b, t, kv, hd)
        if s.rope:
            q, k = apply_rotary(q, self.freqs[:t]), apply_rotary(k, self.freqs[:t])
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if kv < h and (s.gqa == "repeat" or s.impl == "written"):
            k, v = k.repeat_interleave(h // kv, dim=1), v.repeat_interleave(h // kv, dim=1)
        mask = mask if s.mask == "input" else getattr(self, "mask", None)
        if s.impl == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=s.mask == "causal",
                                               enable_gqa=kv < h and s.gqa == "sdpa")
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(hd)
            if mask is not None and mask.dtype == torch.bool:
                scores = scores.masked_fill(~mask, float("-inf"))
            elif mask is not None:
                scores = scores + mask
            o = scores.softmax(dim=-1) @ v
        return x + self.wo(o.transpose(1, 2).reshape(b, t, h * hd))


class MLPBlock(nn.Module):
    def __init__(self, spec: MLP, dim: int):
        super().__init__()
        self.s = spec
        self.norm = _norm(spec.norm, dim)
        self.w1 = nn.Linear(dim, spec.hidden, bias=spec.bias)
        self.w2 = nn.Linear(spec.hidden, dim, bias=spec.bias)
        if spec.gated:
            self.w3 = nn.Linear(dim, spec.hidden, bias=spec.bias)

    def forward(self, x, mask=None):
        y = self.norm(x)
        a = ACTS[self.s.act](self.w1(y))
        return x + self.w2(a * self.w3(y) if self.s.gated else a)


class TokenMixBlock(nn.Module):
    def __init__(self, spec: TokenMix, dim: int, seq: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(seq, spec.hidden)
        self.fc2 = nn.Linear(spec.hidden, seq)

    def forward(self, x, mask=None):
        y = self.norm(x).transpose(1, 2)
        return x + self.fc2(F.gelu(self.fc1(y))).transpose(1, 2)


class SoftmaxGateBlock(nn.Module):
    def __init__(self, spec: SoftmaxGate, dim: int):
        super().__init__()
        self.t = spec.temperature
        self.gate = nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        return x * torch.softmax(self.gate(x) / self.t, dim=-1)


class GroupLinearBlock(nn.Module):
    def __init__(self, spec: GroupLinear, dim: int):
        super().__init__()
        self.g = spec.groups
        self.fc = nn.Linear(dim // spec.groups, dim // spec.groups)

    def forward(self, x, mask=None):
        b, t, d = x.shape
        y = x.reshape(b, t, self.g, d // self.g).permute(0, 2, 1, 3)
        return x + self.fc(y).permute(0, 2, 1, 3).reshape(b, t, d)


class SeqConvBlock(nn.Module):
    def __init__(self, spec: SeqConv, dim: int):
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, spec.kernel, padding=spec.kernel // 2, groups=dim if spec.depthwise else 1)

    def forward(self, x, mask=None):
        return x + F.silu(self.conv(x.transpose(1, 2))).transpose(1, 2)


class MHABlock(nn.Module):
    def __init__(self, spec: MHA, dim: int, seq: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, spec.heads, bias=spec.bias, batch_first=True)
        if spec.causal:  # True where attention is not allowed
            self.register_buffer("mask", torch.ones(seq, seq, dtype=torch.bool).triu(1))

    def forward(self, x, mask=None):
        y = self.norm(x)
        return x + self.attn(y, y, y, attn_mask=getattr(self, "mask", None), need_weights=False)[0]


def _block(spec: Block, dim: int, seq: int, gen: torch.Generator) -> nn.Module:
    if isinstance(spec, Attn):
        return AttnBlock(spec, dim, seq, gen)
    if isinstance(spec, MLP):
        return MLPBlock(spec, dim)
    if isinstance(spec, TokenMix):
        return TokenMixBlock(spec, dim, seq)
    if isinstance(spec, SoftmaxGate):
        return SoftmaxGateBlock(spec, dim)
    if isinstance(spec, SeqConv):
        return SeqConvBlock(spec, dim)
    if isinstance(spec, MHA):
        return MHABlock(spec, dim, seq)
    return GroupLinearBlock(spec, dim)


class FuzzModel(nn.Module):
    """The model a ModelSpec describes."""

    def __init__(self, spec: ModelSpec, gen: torch.Generator):
        super().__init__()
        self.s = spec
        if spec.stem == "tokens":
            self.embed = nn.Embedding(spec.in_dim, spec.dim)
        elif spec.stem == "features":
            self.embed = nn.Linear(spec.in_dim, spec.dim)
        else:
            self.embed = nn.Conv2d(spec.in_dim, spec.dim, kernel_size=2, stride=2)
        if spec.positions:
            self.pos = nn.Embedding(spec.seq, spec.dim)
        self.blocks = nn.ModuleList(_block(b, spec.dim, spec.seq, gen) for b in spec.blocks)
        self.norm = _norm(spec.final_norm, spec.dim)
        if spec.head == "linear":
            self.head = nn.Linear(spec.dim, spec.out_dim, bias=False)
        elif spec.head == "tied":
            self.head = nn.Linear(spec.dim, spec.in_dim, bias=False)
            self.head.weight = self.embed.weight

    def forward(self, x, mask=None):
        h = self.embed(x)
        if self.s.stem == "patches":
            h = h.flatten(2).transpose(1, 2)
        if self.s.positions:
            h = h + self.pos(torch.arange(h.shape[1], device=h.device))
        for block in self.blocks:
            h = block(h, mask)
        if self.s.repeat_first:
            h = self.blocks[0](h, mask)
        h = self.norm(h)
        if self.s.loss:
            logits = self.head(h)[:, :-1]
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1) % logits.shape[-1])
        out = self.head(h) if self.s.head != "none" else h
        return (out, h) if self.s.two_outputs else out


def _patch_grid(seq: int) -> tuple[int, int]:
    rows = max(r for r in range(1, int(math.isqrt(seq)) + 1) if seq % r == 0)
    return rows, seq // rows


def build(spec: ModelSpec) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """(model in fp64, train mode; inputs), both drawn from spec.seed: the same on every rank."""
    gen = torch.Generator().manual_seed(spec.seed)
    torch.manual_seed(spec.seed)
    model = in_dtype(F64, FuzzModel, spec, gen).train()
    for p in model.parameters():  # norms start at ones and zeros: perturb them so their gradients are generic
        with torch.no_grad():
            p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    b, s = spec.batch, spec.seq
    if spec.stem == "tokens":
        x = torch.randint(0, spec.in_dim, (b, s), generator=gen)
    elif spec.stem == "features":
        x = torch.randn(b, s, spec.in_dim, generator=gen, dtype=F64)
    else:
        rows, cols = _patch_grid(s)
        x = torch.randn(b, spec.in_dim, 2 * rows, 2 * cols, generator=gen, dtype=F64)
    if any(isinstance(blk, Attn) and blk.mask == "input" for blk in spec.blocks):
        mask = (torch.rand(s, s, generator=gen) < 0.6) | torch.eye(s, dtype=torch.bool)
        return model, (x, mask)
    return model, (x,)


# --- hypothesis strategies --------------------------------------------------------------------

NORMS = st.sampled_from(["layer", "rms", "batch", "none"])
ODD = st.sampled_from([2, 3, 5, 6, 7, 8, 12, 13, 16, 30])  # 2, 3: fewer rows than ranks


@st.composite
def attn(draw) -> Attn:
    kv = draw(st.sampled_from([1, 2, 3]))
    heads = kv * draw(st.sampled_from([1, 2, 3]))
    rope = draw(st.booleans())
    head_dim = draw(st.sampled_from([2, 4, 6] if rope else [2, 3, 4, 5]))
    impl = draw(st.sampled_from(["sdpa", "written"]))
    return Attn(heads=heads, kv_heads=kv, head_dim=head_dim, norm=draw(NORMS), fused_qkv=draw(st.booleans()),
                bias=draw(st.booleans()), gqa=draw(st.sampled_from(["repeat", "sdpa"])), impl=impl,
                mask=draw(st.sampled_from(["none", "causal", "bool", "additive", "input"])), rope=rope)


def blocks(dim: int) -> st.SearchStrategy:
    groups = [g for g in (2, 3, 4) if dim % g == 0 and g < dim]
    options = [
        attn(),
        st.builds(MLP, hidden=ODD, act=st.sampled_from(list(ACTS)), gated=st.booleans(), norm=NORMS,
                  bias=st.booleans()),
        st.builds(TokenMix, hidden=ODD),
        st.builds(SoftmaxGate, temperature=st.sampled_from([0.5, 1.0, 2.0])),
        st.builds(SeqConv, kernel=st.sampled_from([1, 3, 5]), depthwise=st.booleans()),
        st.builds(MHA, heads=st.sampled_from([h for h in (1, 2, 3, 4) if dim % h == 0]), causal=st.booleans(),
                  bias=st.booleans()),
    ] + ([st.builds(GroupLinear, groups=st.sampled_from(groups))] if groups else [])
    return st.one_of(*options)


@st.composite
def model_specs(draw, max_blocks: int = 3) -> ModelSpec:
    """A random ModelSpec: 1 to max_blocks blocks on a residual stream of odd or even width."""
    stem = draw(st.sampled_from(["tokens", "features", "patches"]))
    dim = draw(st.sampled_from([3, 6, 7, 8, 12, 13, 15, 16]))
    head = draw(st.sampled_from(["linear", "tied", "none"] if stem == "tokens" else ["linear", "none"]))
    spec = ModelSpec(
        stem=stem, batch=draw(st.integers(1, 3)), seq=draw(st.sampled_from([2, 3, 4, 5, 6, 7, 8])), dim=dim,
        in_dim=draw(st.sampled_from([2, 3, 5, 11, 17])), blocks=tuple(draw(st.lists(blocks(dim), min_size=1,
                                                                                   max_size=max_blocks))),
        final_norm=draw(NORMS), head=head, out_dim=draw(st.sampled_from([1, 2, 3, 7, 10])),
        seed=draw(st.integers(0, 2**16)), positions=draw(st.booleans()), repeat_first=draw(st.booleans()),
        two_outputs=draw(st.booleans()),
        loss=stem == "tokens" and head != "none" and draw(st.booleans()))
    if spec.loss and spec.head == "linear" and spec.out_dim == 1:  # one class: the loss is 0 whatever the model
        spec = replace(spec, out_dim=2)
    return spec
