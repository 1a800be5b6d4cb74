"""WeatherMixer as the Jigsaw paper trains it (arXiv 2507.05753; its SC code, DeifiliaTo/Jigsaw_SC).

An MLP-Mixer on global ERA5 fields: 69 variables (5 fields on 13 pressure levels and 4 at the
surface) on a 720 x 1440 latitude-longitude grid, with 3 constant fields (land mask, soil type,
topography) appended. The grid is flattened and cut into 1-D patches of `patch` points along
the longitude by a strided Conv1d (720 x 1440 / 60 = 17,280 tokens); mixer blocks mix tokens
and channels; the latent is concatenated with the embedding's output, turned back into fields
by a strided ConvTranspose1d, concatenated with the input fields, and a linear head maps the
138 values per grid point to 69. Written here from the paper's description and configs, in
plain torch; tiny sizes make it a test model.
"""

from __future__ import annotations

import torch
from torch import nn

CONSTANT_FIELDS = 3  # land mask, soil type, topography


class MLP(nn.Module):
    """Linear, GELU, dropout, linear, dropout."""

    def __init__(self, dim: int, hidden: int, dropout: float):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.drop1, self.drop2 = nn.Dropout(dropout), nn.Dropout(dropout)

    def forward(self, x):
        return self.drop2(self.fc2(self.drop1(nn.functional.gelu(self.fc1(x)))))


class MixerBlock(nn.Module):
    """Token mixing (an MLP across the patches), then channel mixing, each pre-norm with a residual."""

    def __init__(self, tokens: int, dim: int, token_hidden: int, channel_hidden: int, dropout: float):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.token_mixing = MLP(tokens, token_hidden, dropout)
        self.channel_mixing = MLP(dim, channel_hidden, dropout)

    def forward(self, x):  # [batch, tokens, dim]
        x = x + self.token_mixing(self.norm1(x).mT).mT
        return x + self.channel_mixing(self.norm2(x))


class WeatherMixer(nn.Module):
    """[batch, fields, lat, lon] -> [batch, lat, lon, fields]: the next state of the fields.

    `spatial_fraction` and `channel_fraction` set the token and channel MLPs' hidden sizes as
    fractions of the token count and of `dim` (the paper's spatial_hidden_dim_fraction and
    features_hidden_dim_fraction).
    """

    def __init__(self, fields: int = 69, lat: int = 720, lon: int = 1440, patch: int = 60, dim: int = 4320,
                 depth: int = 3, spatial_fraction: float = 0.5, channel_fraction: float = 1.0,
                 dropout: float = 0.0):
        super().__init__()
        if (lat * lon) % patch:
            raise ValueError(f"lat x lon = {lat * lon} points must split into patches of {patch}")
        self.fields, self.lat, self.lon = fields, lat, lon
        tokens = lat * lon // patch
        self.register_buffer("constants", torch.rand(CONSTANT_FIELDS, lat, lon), persistent=False)
        self.embed = nn.Conv1d(fields + CONSTANT_FIELDS, dim, patch, stride=patch)
        self.blocks = nn.Sequential(*(MixerBlock(tokens, dim, int(tokens * spatial_fraction),
                                                 int(dim * channel_fraction), dropout) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.recover = nn.ConvTranspose1d(2 * dim, fields, patch, stride=patch)
        self.norm_fields = nn.LayerNorm(fields)
        self.norm_joined = nn.LayerNorm(2 * fields)
        self.head = nn.Linear(2 * fields, fields)

    def forward(self, x):
        b = x.shape[0]
        constants = self.constants.to(x.dtype).expand(b, -1, -1, -1)  # stays fp32 under FSDP2 mixed precision
        points = torch.cat((x, constants), dim=1).flatten(2)  # [b, fields + 3, lat * lon]
        embedded = self.embed(points).mT  # [b, tokens, dim]
        latent = torch.cat((self.norm(self.blocks(embedded)), embedded), dim=-1)
        fields = self.recover(latent.mT).mT.reshape(b, self.lat, self.lon, self.fields)
        joined = torch.cat((self.norm_fields(fields), x.permute(0, 2, 3, 1)), dim=-1)
        return self.head(self.norm_joined(joined))


class FieldLoss(nn.Module):
    """The training objective as a module (so it runs sharded too): the mean squared error."""

    def __init__(self, **sizes):
        super().__init__()
        self.mixer = WeatherMixer(**sizes)

    def forward(self, x, target):
        return nn.functional.mse_loss(self.mixer(x), target)
