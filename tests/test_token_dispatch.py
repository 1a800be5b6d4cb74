"""The token-dispatch kernel (kernels/token_dispatch.py) against routed experts on one device.

Each rank holds its share of the tokens and a block of the experts; the kernel's outputs and the
gradients of its tokens, scores and experts must equal the single device's, and the bytes its
all-to-alls send must be the rows the routing sends to other ranks. Routings: random, every token
to rank 0's experts (the worst imbalance), an expert no token chooses, and top-k equal to the
number of experts; experts that the ranks do not divide (uneven blocks, a rank with none); fp64
over transformers' grouped-matmul fallback, fp32 and bf16 over torch._grouped_mm.
"""

import pytest
import torch
import torch.distributed as dist
import transformers.integrations.moe  # noqa: F401  (defines transformers.grouped_mm_fallback)

from autojigsaw.capture.routed_experts import routed_experts
from autojigsaw.kernels import collectives as C
from autojigsaw.kernels.token_dispatch import token_dispatch
from autojigsaw.mesh import MeshAxis
from autojigsaw.placements import chunk_sizes

FALLBACK, GROUPED = "transformers.grouped_mm_fallback.default", "aten._grouped_mm.default"
H, INTER = 8, 8  # rows of 16 bytes at least in bf16, as torch._grouped_mm needs
# relative to the largest value: fp64 and fp32 differ by the GEMMs' summation order on other rows;
# bf16 by one rounding of each output and gradient (the same products, summed in another order in fp32)
TOL = {torch.float64: 16 * torch.finfo(torch.float64).eps, torch.float32: 64 * torch.finfo(torch.float32).eps,
       torch.bfloat16: 2.0**-7}


def routing(case: str, tokens: int, experts: int, k: int, block0: int) -> torch.Tensor:
    """[tokens, k] distinct experts per token, as a router's top-k gives them."""
    g = torch.Generator().manual_seed(1)
    if case == "top-k = experts":
        return torch.stack([torch.randperm(experts, generator=g) for _ in range(tokens)])
    pool = {"random": list(range(experts)), "all to rank 0": list(range(block0)),
            "an expert without tokens": [e for e in range(experts) if e != 1]}[case]
    return torch.stack([torch.tensor(pool)[torch.randperm(len(pool), generator=g)[:k]] for _ in range(tokens)])


def _inputs(case, experts, k, dtype, n):
    torch.manual_seed(0)
    tokens = 4 * n
    x = torch.randn(tokens, H, dtype=dtype)
    index = routing(case, tokens, experts, k, chunk_sizes(experts, n)[0])
    weights = torch.rand(tokens, index.shape[1], dtype=dtype)
    w1 = torch.randn(experts, H, 2 * INTER, dtype=dtype) / 3
    w2 = torch.randn(experts, INTER, H, dtype=dtype) / 3
    g = torch.randn(tokens, H, dtype=dtype)
    return x, index, weights, w1, w2, g


def _kernel_case(case, experts, k, dtype, mm):
    """(relative errors of output and the four gradients, collectives run) on this rank."""
    n, r = dist.get_world_size(), dist.get_rank()
    axis = MeshAxis("experts", n, dist.group.WORLD.group_name, r)
    x, index, weights, w1, w2, g = _inputs(case, experts, k, dtype, n)
    full = [t.clone().requires_grad_() for t in (x, weights, w1, w2)]
    want = routed_experts(full[0], index, full[1], full[2], full[3], mm, "silu", True)
    want_grads = torch.autograd.grad(want, full, g)
    blocks = chunk_sizes(experts, n)
    tok = slice(r * x.shape[0] // n, (r + 1) * x.shape[0] // n)
    own = slice(sum(blocks[:r]), sum(blocks[:r + 1]))
    mine = [t.detach().requires_grad_() for t in (x[tok], weights[tok], w1[own], w2[own])]
    with C.count_comm() as log:
        got = token_dispatch(mine[0], index[tok], mine[1], mine[2], mine[3], mm=mm, act="silu", gated=True,
                             experts=blocks, axis=axis)
        got.backward(g[tok])

    def err(a, b):
        if not b.numel():  # a rank without experts
            return 0.0 if a.shape == b.shape else float("inf")
        return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()

    errors = [err(got, want[tok])] + [err(m.grad, w[s]) for m, w, s in zip(mine, want_grads, (tok, tok, own, own))]
    return errors, log.calls


def rows_between(index: torch.Tensor, blocks: tuple[int, ...], n: int) -> list[list[int]]:
    """rows[r][q]: the routed rows rank r's tokens send to rank q's experts."""
    owner = torch.repeat_interleave(torch.arange(n), torch.tensor(blocks))
    tok = index.shape[0] // n
    return [[int((owner[index[r * tok:(r + 1) * tok]] == q).sum()) for q in range(n)] for r in range(n)]


def _expected_calls(index, blocks, n, r, size) -> list[tuple[str, str, int]]:
    rows = rows_between(index, blocks, n)
    out_rows = sum(rows[r][q] for q in range(n) if q != r)  # this rank's rows to other ranks' experts
    in_rows = sum(rows[q][r] for q in range(n) if q != r)  # other ranks' rows to this rank's experts
    counts = (sum(blocks) - blocks[r]) * 8  # this rank's int64 counts of the others' experts
    sends = [counts, out_rows * H * size, in_rows * H * size, out_rows * H * size, in_rows * H * size]
    return [("all_to_all", "experts", b) for b in sends]  # counts, dispatch, combine; combine's and dispatch's adjoints


def _check(results, case, experts, k, dtype):
    n = len(results)
    index = _inputs(case, experts, k, dtype, n)[1]
    blocks = chunk_sizes(experts, n)
    for r, (errors, calls) in enumerate(results):
        assert max(errors) <= TOL[dtype], (r, errors)
        assert calls == _expected_calls(index, blocks, n, r, dtype.itemsize), (r, calls)


CASES = ["random", "all to rank 0", "an expert without tokens", "top-k = experts"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype, mm", [(torch.float64, FALLBACK), (torch.float32, GROUPED), (torch.bfloat16, GROUPED)],
                         ids=["fp64-fallback", "fp32-grouped_mm", "bf16-grouped_mm"])
def test_kernel_on_two_ranks_equals_one_device_and_sends_the_routed_rows(ranks2, case, dtype, mm):
    k = 4 if case == "top-k = experts" else 2
    _check(ranks2.run(_kernel_case, case, 4, k, dtype, mm), case, 4, k, dtype)


@pytest.mark.parametrize("case, experts", [("random", 8), ("all to rank 0", 8), ("an expert without tokens", 7),
                                           ("top-k = experts", 3)],
                         ids=["random", "all to rank 0", "an expert without tokens, 7 experts", "top-k = 3 experts"])
def test_kernel_on_four_ranks_with_uneven_experts(ranks4, case, experts):
    """7 experts over 4 ranks: blocks of 2, 2, 2, 1 (torch.chunk's); 3 experts: 1, 1, 1 and a rank with none."""
    k = experts if case == "top-k = experts" else 2
    _check(ranks4.run(_kernel_case, case, experts, k, torch.float64, FALLBACK), case, experts, k, torch.float64)


def _compiled_case(dtype, mm):
    """(largest error of the compiled kernel's output and gradients against one device, relative)."""
    torch._dynamo.config.capture_scalar_outputs = True  # as the rewrite sets it for a plan with a token dispatch
    n, r = dist.get_world_size(), dist.get_rank()
    axis = MeshAxis("experts", n, dist.group.WORLD.group_name, r)
    x, index, weights, w1, w2, g = _inputs("random", 4, 2, dtype, n)
    full = [t.clone().requires_grad_() for t in (x, w1, w2)]
    want = routed_experts(full[0], index, weights, full[1], full[2], mm, "silu", True)
    want_grads = torch.autograd.grad(want, full, g)
    tok, own = slice(r * 4, (r + 1) * 4), slice(2 * r, 2 * r + 2)
    mine = [t.detach().requires_grad_() for t in (x[tok], w1[own], w2[own])]

    def dispatched(x, index, weights, w1, w2):
        return token_dispatch(x, index, weights, w1, w2, mm=mm, act="silu", gated=True, experts=(2, 2), axis=axis)

    got = torch.compile(dispatched, fullgraph=True)(mine[0], index[tok], weights[tok], mine[1], mine[2])
    got.backward(g[tok])
    pairs = [(got, want[tok])] + [(m.grad, w[s]) for m, w, s in zip(mine, want_grads, (tok, own, own))]
    return max(((a.double() - b.double()).abs().max() / b.double().abs().max()).item() for a, b in pairs)


@pytest.mark.parametrize("dtype, mm", [(torch.float32, FALLBACK), (torch.bfloat16, GROUPED)],
                         ids=["fp32-fallback", "bf16-grouped_mm"])
def test_kernel_compiles_fullgraph_with_the_counts_as_data_dependent_sizes(ranks2, dtype, mm):
    """Inductor, fullgraph: the counts read on the host are unbacked sizes, the all-to-alls functional collectives."""
    for error in ranks2.run(_compiled_case, dtype, mm):
        assert error <= TOL[dtype], error
