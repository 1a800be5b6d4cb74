"""The parallelized model as an nn.Module: its module tree is the model's, and copies of it (as EMA
training makes them: copy.deepcopy and AveragedModel) train like one device.

The copy has its own parameter shards and runs the original's programs; both train and average
like the single-device model and its copy. Under FSDP, FSDP itself refuses a deepcopy; an average
kept of the parameters (docs/support.md) matches one device there.
"""

import copy

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import autojigsaw
from autojigsaw.testing.local_ranks import get_mesh

from .side_by_side import whole

F64 = torch.float64
DECAY = 0.9
ROUNDOFF = 32 * torch.finfo(F64).eps  # values of order 1; a sharded sum rounds in another order


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)).to(F64)


def _steps(model, average, x, update) -> None:
    """Two SGD steps of `model`, each followed by `update(average, model)`."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
        update(average, model)


def _ema_side_by_side(how: str) -> dict:
    """Largest differences from one device of the averaged model's output and parameters, and of
    the trained model's output, after two steps; the averaged copy made by `how`."""
    x = torch.randn(4, 16, dtype=F64, generator=torch.Generator().manual_seed(1))
    ref = _model()
    pmodel = autojigsaw.parallelize(copy.deepcopy(ref), get_mesh((2,), ("tensor",)), (x,), compile=False,
                                    memory_budget=60_000)
    assert any(not p.placements[0].is_replicate() for p in pmodel.parameters()), pmodel.plan.table()
    pmodel(x)  # a program already built and in use when the copy is made
    if how == "deepcopy":
        def update(avg, model):
            with torch.no_grad():
                for a, p in zip(avg.parameters(), model.parameters()):
                    a.lerp_(p, 1 - DECAY)
        averaged, ref_averaged = copy.deepcopy(pmodel), copy.deepcopy(ref)
    else:
        def update(avg, model):
            avg.update_parameters(model)
        averaged = AveragedModel(pmodel, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
        ref_averaged = AveragedModel(ref, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
    _steps(pmodel, averaged, x, update)
    _steps(ref, ref_averaged, x, update)
    return {"averaged output": (averaged(x) - ref_averaged(x)).abs().max().item(),
            "averaged parameters": max((whole(a) - b).abs().max().item()
                                       for a, b in zip(averaged.parameters(), ref_averaged.parameters())),
            "trained output": (pmodel(x) - ref(x)).abs().max().item()}


def test_deepcopy_and_averaged_model_average_like_one_device(ranks2):
    for how in ("deepcopy", "AveragedModel"):
        for diffs in ranks2.run(_ema_side_by_side, how):
            assert all(d <= ROUNDOFF for d in diffs.values()), (how, diffs)


def _fsdp_copy() -> tuple[str, float]:
    """FSDP's error on copy.deepcopy, and how far an average of the parameters is from one device's."""
    x = torch.randn(4, 16, dtype=F64, generator=torch.Generator().manual_seed(1))
    ref = _model()
    pmodel = autojigsaw.parallelize(copy.deepcopy(ref), get_mesh((2,), ("data",)), (x,), compile=False)
    try:
        copy.deepcopy(pmodel)
        error = ""
    except RuntimeError as e:
        error = str(e)

    def update(avg, model):
        torch._foreach_lerp_(avg, [p.detach() for p in model.parameters()], 1 - DECAY)
    ema = [p.detach().clone() for p in pmodel.parameters()]
    ref_ema = [p.detach().clone() for p in ref.parameters()]
    _steps(pmodel, ema, x, update)
    _steps(ref, ref_ema, x, update)
    return error, max((whole(a) - b).abs().max().item() for a, b in zip(ema, ref_ema))


def test_under_fsdp_deepcopy_is_refused_and_an_average_of_the_parameters_works(ranks2):
    for error, diff in ranks2.run(_fsdp_copy):
        assert "FSDP does not support deepcopy" in error, error
        assert diff <= ROUNDOFF, diff


def _names(module: torch.nn.Module) -> tuple[list, list, list]:
    return [n for n, _ in module.named_modules()], [n for n, _ in module.named_parameters()], list(module.state_dict())


def _trees() -> tuple[tuple, tuple, bool]:
    ref = _model()
    pmodel = autojigsaw.parallelize(copy.deepcopy(ref), get_mesh((2,), ("tensor",)), (torch.randn(4, 16, dtype=F64),),
                                    compile=False)
    items = all(pmodel[i] is getattr(pmodel, str(i % 3)) for i in (0, 2, -1))
    return _names(pmodel), _names(ref), items


def test_the_module_tree_is_the_models(ranks2):
    """The rewritten graph was a submodule ("_graph"): in print(pmodel), modules(), apply and hook loops.
    An nn.Sequential root's items are indexed as on the model (pmodel[-1] was a TypeError)."""
    for mine, want, items in ranks2.run(_trees):
        assert mine == want, (mine, want)
        assert items
