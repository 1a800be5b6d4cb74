"""A weather-style MLP-Mixer: lat-lon fields -> patch tokens -> mixer blocks -> fields.

As in Jigsaw's WeatherMixer: a strided convolution embeds p x p patches of a multi-channel
latitude-longitude field, each block mixes tokens (an MLP across patches) and channels (an MLP
per patch) behind LayerNorms, and a linear head with a reshape recovers the field; no norm
before the head, so the token MLP's bias (a per-token shift that every LayerNorm removes) still
reaches the output and has a gradient. Shared by examples/weather_mixer.py and the tests.
"""

from __future__ import annotations

from torch import nn


class MixerBlock(nn.Module):
    """Token mixing across patches, then channel mixing, each behind a LayerNorm with a residual."""

    def __init__(self, tokens: int, dim: int, token_hidden: int, channel_hidden: int, *,
                 bias: bool = True):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.token_fc1 = nn.Linear(tokens, token_hidden, bias=bias)
        self.token_fc2 = nn.Linear(token_hidden, tokens, bias=bias)
        self.norm2 = nn.LayerNorm(dim)
        self.channel_fc1 = nn.Linear(dim, channel_hidden, bias=bias)
        self.channel_fc2 = nn.Linear(channel_hidden, dim, bias=bias)

    def forward(self, x):  # x [batch, tokens, dim]
        t = self.norm1(x).transpose(1, 2)
        x = x + self.token_fc2(nn.functional.gelu(self.token_fc1(t))).transpose(1, 2)
        return x + self.channel_fc2(nn.functional.gelu(self.channel_fc1(self.norm2(x))))


class WeatherMixer(nn.Module):
    """[batch, channels, lat, lon] -> the same shape, through p x p patch tokens."""

    def __init__(self, channels: int = 3, lat: int = 8, lon: int = 8, patch: int = 2,
                 dim: int = 16, token_hidden: int = 24, channel_hidden: int = 32, depth: int = 2):
        super().__init__()
        self.patch, self.channels = patch, channels
        self.grid = (lat // patch, lon // patch)
        tokens = self.grid[0] * self.grid[1]
        self.embed = nn.Conv2d(channels, dim, patch, stride=patch)
        self.blocks = nn.Sequential(*(MixerBlock(tokens, dim, token_hidden, channel_hidden)
                                      for _ in range(depth)))
        self.head = nn.Linear(dim, channels * patch * patch)

    def forward(self, x):
        b = x.shape[0]
        tokens = self.embed(x).flatten(2).transpose(1, 2)  # [b, lat/p * lon/p, dim]
        y = self.head(self.blocks(tokens))  # [b, tokens, channels * p * p]
        (h, w), p = self.grid, self.patch
        y = y.reshape(b, h, w, self.channels, p, p).permute(0, 3, 1, 4, 2, 5)
        return y.reshape(b, self.channels, h * p, w * p)


class FieldLoss(nn.Module):
    """The training objective as a module, so it runs sharded too: mean squared error of the field."""

    def __init__(self, **sizes):
        super().__init__()
        self.mixer = WeatherMixer(**sizes)

    def forward(self, x, target):
        return (self.mixer(x) - target).square().sum() / target.numel()
