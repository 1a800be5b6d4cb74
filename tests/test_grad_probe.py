"""The guard against silent wrong gradients: every model of the suite, one random probe, every mesh.

Each parameter's gradient, and each floating input's, must equal the single-device one to a few
units of roundoff of the dtype the model computes in (fp64, or fp32 inside complex RoPE). A dropped
shard or a missing sum is off by percents (the complex RoPE bug: 2.6 %; an input named `input`: 14 %).
"""

import pytest

from .grad_probe import MODELS, plan_json, probe_all

# 1-D and 2-D; "domain" alone is the same axis kind as "tensor" (names are labels) and 2x2 covers both.
MESHES = {"tensor2": {"tensor": 2}, "2x2": {"domain": 2, "tensor": 2}}
ROUNDOFF_UNITS = 64  # a sharded sum rounds in another order: a few units per op, over a few dozen ops


@pytest.mark.parametrize("mesh_id", list(MESHES))
def test_every_parameter_gradient_matches_single_device(request, mesh_id):
    mesh = MESHES[mesh_id]
    pool = request.getfixturevalue("ranks4" if len(mesh) == 2 else "ranks2")
    names = list(MODELS)
    plans = {name: plan_json(name, mesh) for name in names}
    results = pool.run(probe_all, names, plans, tuple(mesh.values()), tuple(mesh), timeout=600)
    wrong, unsharded = [], []
    for rank, by_model in enumerate(results):
        for name, r in by_model.items():
            unsharded += [name] if r["sharded"] == 0 and rank == 0 else []
            wrong += [(rank, name, key, err) for key, err in r["errors"].items()
                      if not err <= ROUNDOFF_UNITS * r["unit"]]
    worst = {}
    for by_model in results:
        for name, r in by_model.items():
            worst[name] = max(worst.get(name, 0.0), max(r["errors"].values()) / r["unit"])
    print(mesh_id, {k: f"{v:.2g}" for k, v in worst.items()})
    assert not wrong, wrong
    assert len(unsharded) <= len(names) // 4, f"too few models shard their weights on {mesh}: {unsharded}"
