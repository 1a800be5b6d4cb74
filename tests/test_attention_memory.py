"""Per-rank memory of attention activations: what autograd saves for backward, measured.

With the sequence sharded over N ranks the ring saves this rank's q, k, v, output and
log-sum-exp: S / N tokens each, the single-device bytes over N at every length. Gathering
K and V instead saves them whole (growing with S), and for causal attention the mask shifted
to this rank's rows (with S^2 / N).
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

import autojigsaw
from autojigsaw.mesh import MeshSpec
from autojigsaw.testing.local_ranks import get_mesh

from .attention_cases import SDPA, Attention, forced_plan

HEADS, DIM = 2, 16


def _saved_bytes(fn) -> int:
    """Bytes of the distinct tensors autograd saves while `fn` runs."""
    seen: dict[tuple, int] = {}

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        seen[key] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def _qkv(seq_len: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seq_len)
    return [torch.randn(1, HEADS, seq_len, DIM, generator=gen, requires_grad=True) for _ in range(3)]


def saved_case(kernel: str, seq_len: int) -> int:
    """Bytes this rank's attention saves, its q, k, v arriving sequence-sharded (S(2))."""
    n, r = dist.get_world_size(), dist.get_rank()
    mesh = get_mesh((n,), ("domain",))
    model, full = Attention(causal=True), _qkv(seq_len)
    placements = [(Shard(2),)] * 3
    plan = forced_plan(model, full, MeshSpec.of(mesh), {SDPA: (kernel, "S(2)")}, input_placements=placements)
    pmodel = autojigsaw.parallelize(model, mesh, full, plan=plan, compile=False, input_placements=placements)
    local = [t.detach().chunk(n, 2)[r].requires_grad_() for t in full]
    return _saved_bytes(lambda: pmodel(*local))


def test_ring_saves_a_1_over_n_share_at_every_length(ranks2, ranks4):
    single = {s: _saved_bytes(lambda s=s: Attention(causal=True)(*_qkv(s))) for s in (64, 128)}
    assert single[128] == 2 * single[64]  # q, k, v, out, lse: linear in S on one device too
    for pool in (ranks2, ranks4):
        n = pool.world_size
        for seq_len in (64, 128):
            for kernel in ("ring_attention", "ring_attention_zigzag"):
                saved = pool.run(saved_case, kernel, seq_len)
                assert saved == [single[seq_len] // n] * n, (kernel, n, seq_len, saved)


def test_gathered_kv_saves_whole_keys_and_values(ranks2):
    token = HEADS * DIM * 4  # bytes of one fp32 token of q, k or v
    for seq_len in (64, 128):
        ring, gathered = (ranks2.run(saved_case, kernel, seq_len)[0]
                          for kernel in ("ring_attention", "kv_gather_attention"))
        # K and V whole instead of this rank's half of them, and the causal mask shifted to this
        # rank's rows, which SDPA saves as floats: [S / 2, S]
        extra = 2 * token * seq_len // 2 + seq_len // 2 * seq_len * 4
        assert gathered - ring == extra, (seq_len, ring, gathered)
