"""Which layout the planner picks for the weather mixer on a 2 x 2 H100 mesh, and what it says why.

No processes: the models live on the meta device. Activations that dominate (a large field,
small weights) are sharded along tokens over both axes, weights stay whole where used (domain
parallelism); weights that dominate are split Megatron-style over both axes while every rank
sees all tokens (tensor parallelism); when both are large one axis shards the tokens and the
other the weights (2-D, Jigsaw's layout). The plan table's notes name the sharding per axis.
"""

import pytest
import torch

import autojigsaw

from .jigsaw_common import WeatherMixer

CASES = {  # batch, model sizes, what the channel MLP's two linears do on (domain, tensor)
    "activations": (8, dict(channels=8, lat=512, lon=512, patch=8, dim=256, token_hidden=256,
                            channel_hidden=512), {"token"}, {"token"}),
    "weights": (1, dict(channels=8, lat=32, lon=32, patch=4, dim=1024, token_hidden=64,
                        channel_hidden=4096), {"column", "row"}, {"column", "row"}),
    "both": (1, dict(channels=8, lat=512, lon=512, patch=8, dim=1024, token_hidden=1024,
                     channel_hidden=4096), {"column", "row"}, {"token"}),
}


def _axis_notes(note: str) -> dict[str, str]:
    """"domain: token; tensor: column" -> {"domain": "token", "tensor": "column"}."""
    return dict(part.split(": ", 1) for part in note.split("; ") if part)


@pytest.mark.parametrize("case", CASES)
def test_planner_shards_what_dominates(case):
    batch, sizes, domain, tensor = CASES[case]
    with torch.device("meta"):
        model = WeatherMixer(depth=1, **sizes)
    x = torch.empty(batch, sizes["channels"], sizes["lat"], sizes["lon"], device="meta")
    plan = autojigsaw.plan(model, (x,), {"domain": 2, "tensor": 2}, device="h100")
    table = plan.table(wide=True)
    for name in ("linear_2", "linear_3"):  # channel_fc1, channel_fc2
        got = _axis_notes(plan.node(name).note)
        got = (got.get("domain"), got.get("tensor"))
        # both axes of a 2 x 2 mesh cross the same NVLink: which one shards the tokens is a tie
        swapped = case == "both" and got[1] in domain and got[0] in tensor
        assert (got[0] in domain and got[1] in tensor) or swapped, (name, table)
        assert plan.node(name).note in table
