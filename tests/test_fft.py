"""FFTs sharded over the dims they do not transform train as on one device.

A spectral mixer (FourCastNet's AFNO, an FNO layer) transforms a field over its spatial dims;
samples and channels are a batch to the FFT, so their shards need no communication
(strategies/rules/fft.py). Trained beside the single-device model (outputs, gradients of
parameters and inputs, two Adam steps) on a 2x2 mesh, the transforms pinned to one layout.
"""

from functools import partial

import pytest
import torch
from torch import nn

from .jigsaw_common import assert_matches, inputs_are, pinned_plan, seeded, train_side_by_side

F64 = torch.float64


class _SpectralMixer(nn.Module):
    """A field (batch, lat, lon, channels) filtered per channel in Fourier space, with a residual."""

    def __init__(self, channels: int = 8, width: int = 16):
        super().__init__()
        self.inp, self.out = nn.Linear(channels, width), nn.Linear(width, channels)
        self.filt = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x):
        h = self.inp(x)
        f = torch.fft.rfft2(h, dim=(1, 2), norm="ortho") * self.filt
        h = h + torch.fft.irfft2(f, s=h.shape[1:3], dim=(1, 2), norm="ortho")
        return self.out(nn.functional.gelu(h))


X = torch.randn(3, 8, 12, 8, generator=torch.Generator().manual_seed(1), dtype=F64)  # 3 samples: uneven shards

PINS = {"samples x channels": "S(0),S(3)", "channels over both axes": "S(3),S(3)"}


@pytest.mark.parametrize("pin", PINS.values(), ids=PINS.keys())
def test_fft_over_untransformed_shards_trains_like_one_device(ranks4, pin):
    make = partial(seeded, _SpectralMixer, F64)
    plan = pinned_plan(make(), (X,), {"domain": 2, "tensor": 2},
                       {"fft_rfft2": inputs_are(pin), "fft_irfft2": inputs_are(pin)})
    assert_matches(ranks4.run(train_side_by_side, make, (X,), (2, 2), plan.to_json()), F64)


def test_transformed_dims_stay_whole():
    with pytest.raises(ValueError, match=r"constraints\['fft_rfft2'\] cannot hold at node fft_rfft2"):
        pinned_plan(_SpectralMixer().double(), (X,), {"domain": 2}, {"fft_rfft2": inputs_are("S(1)")})
