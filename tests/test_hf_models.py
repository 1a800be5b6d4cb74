"""Unmodified Hugging Face models and the weather mixer train exactly as on one device.

Each model runs on a 2-rank "tensor" mesh and a 2 x 2 "domain" x "tensor" mesh, under a memory budget
(70 % of the replicated plan's) that forces a sharded plan: outputs, gradients and the
parameters after three Adam steps must equal the single-device model's in fp64. Llama's RMSNorm
computes in fp32 whatever the model's dtype, so its values agree to fp32 rounding only.
"""

import pytest

from .side_by_side import MODELS, plan_json, train

# "domain" alone plans exactly as "tensor" alone (names are labels; the plans are equal), 2x2 has both
MESHES = [{"tensor": 2}, {"domain": 2, "tensor": 2}]
FP64_TOL = 1e-10
FP32_TOL = 5e-6  # relative to the largest value: a few fp32 roundings (eps 1.2e-7) through the model


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(m))
@pytest.mark.parametrize("name", MODELS)
def test_trains_like_single_device(ranks2, ranks4, name, mesh):
    plan = plan_json(name, mesh)
    pool = ranks4 if len(mesh) == 2 else ranks2
    results = pool.run(train, name, tuple(mesh.values()), tuple(mesh), plan, steps=3)
    assert results[0]["sharded"] > 0, results[0]["table"]
    for r in results:
        tol = FP32_TOL * max(r["scale"], 1.0) if name == "llama" else FP64_TOL
        for key in ("output", "grad", "param"):
            assert r[key] <= tol, (key, r[key], r["table"])
