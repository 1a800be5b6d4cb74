"""Property-based fuzzing: random small models on random meshes equal one device, or say why not.

Every example (tests/fuzz_models.py: embeddings, positions, conv2d patches, conv1d, odd-sized
linears, LayerNorm/RMSNorm/BatchNorm, gated MLPs, attention with odd head counts, GQA, RoPE,
masks, written out or nn.MultiheadAttention, permutes, tied heads, a module used twice, a
cross-entropy loss, two outputs) is planned under a random budget on {"tensor": 2}, {"domain": 2}, {"domain": 2,
"tensor": 2} or {"tensor": 4}, then either matches the single-device model (outputs, every
gradient, one Adam step, to a few dozen units of roundoff) or raises a ValueError naming a node
or parameter and a mesh axis or a fix. Anything else fails, hangs included (the pool's timeout).

Profiles: the default "ci" is derandomized and small (about two minutes on two cores);
`AUTOJIGSAW_FUZZ=long` runs thousands of random examples (AUTOJIGSAW_FUZZ_EXAMPLES, default
2000), by hand; hypothesis stops at the first failure and shrinks it (minutes per step here):

    AUTOJIGSAW_FUZZ=long python -m pytest -q -s tests/test_fuzz.py

A counterexample becomes a plain test in tests/test_fuzz_regressions.py.
"""

import json
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .fuzz_check import ROUNDOFF_UNITS, clear_error, compare_all, plan_or_error
from .fuzz_models import MLP, Attn, ModelSpec, model_specs

MESHES = ({"tensor": 2}, {"domain": 2}, {"domain": 2, "tensor": 2}, {"tensor": 4})
_SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture]
settings.register_profile("ci", max_examples=12, deadline=None, derandomize=True, database=None,
                          suppress_health_check=_SLOW, print_blob=True)
settings.register_profile("long", max_examples=int(os.environ.get("AUTOJIGSAW_FUZZ_EXAMPLES", 2000)),
                          deadline=None, suppress_health_check=_SLOW, print_blob=True)
PROFILE = os.environ.get("AUTOJIGSAW_FUZZ", "ci")
OUTCOMES: dict[str, int] = {}


def check(spec, mesh, fraction, pool) -> tuple[str, str]:
    """Plan here, run on the ranks; ("matched", how many parameters shard) or ("refused", the
    message), or fail."""
    plan, message = plan_or_error(spec, mesh, fraction)
    if plan is not None:
        results = pool.run(compare_all, [(spec, plan)], tuple(mesh.values()), tuple(mesh), timeout=300)
        message = results[0][0].get("error")
    if message is not None:
        assert clear_error(message, spec, mesh), f"unclear ValueError on {mesh}: {message}\n{spec}"
        return "refused", message
    for rank, (r,) in enumerate(results):
        wrong = {k: v for k, v in r["errors"].items() if not v <= ROUNDOFF_UNITS}
        assert not wrong, f"rank {rank} on {mesh}, budget {fraction:.2f}: {wrong}\n{spec}"
    first = results[0][0]
    return "matched", f"{first['sharded']} of {sum(k.startswith('grad ') for k in first['errors'])} parameters sharded"


@settings(settings.get_profile(PROFILE))
@given(spec=model_specs(), mesh=st.sampled_from(MESHES), fraction=st.floats(0.4, 1.0))
def test_random_model_matches_single_device_or_refuses_clearly(ranks2, ranks4, spec, mesh, fraction):
    outcome, message = check(spec, mesh, fraction, ranks4 if len(mesh) == 2 or mesh.get("tensor") == 4 else ranks2)
    OUTCOMES[outcome] = OUTCOMES.get(outcome, 0) + 1
    print(f"fuzz {outcome} {mesh} {fraction:.2f} {OUTCOMES} {message[:120]}", flush=True)


RICH = ModelSpec(stem="tokens", batch=2, seq=7, dim=13, in_dim=17, final_norm="rms", head="tied", out_dim=3, seed=5,
                 blocks=(Attn(heads=6, kv_heads=2, head_dim=4, norm="layer", fused_qkv=True, bias=True, gqa="sdpa",
                              impl="sdpa", mask="causal", rope=True),
                         MLP(hidden=30, act="silu", gated=True, norm="rms", bias=False)))


# Planned first, it would number placements in an order under which RICH's plan comes out another
# (equally fast) way if placement ids were numbered per process, not per graph.
BEFORE = ModelSpec(stem="patches", batch=2, seq=3, dim=15, in_dim=11, final_norm="rms", head="none", out_dim=1,
                   seed=1341, two_outputs=True, blocks=(MLP(hidden=12, act="silu", gated=False, norm="rms", bias=False),))


def test_same_inputs_give_the_same_plan_in_every_process(ranks2):
    """Planned here after another model and on two ranks (other processes, other hash seeds): the same bytes."""
    mesh = {"domain": 2, "tensor": 2}
    plan_or_error(BEFORE, mesh, 0.96)
    here = plan_or_error(RICH, mesh, 0.6)
    there = ranks2.run(plan_or_error, RICH, mesh, 0.6)
    assert here[0] is not None, here[1]
    for rank, p in enumerate(there):
        a, b = json.loads(here[0]), json.loads(p[0])
        assert a == b, (rank, {k: (a[k], b[k]) for k in a if a[k] != b[k] and k != "nodes"},
                        [(x, y) for x, y in zip(a["nodes"], b["nodes"]) if x != y][:3])
