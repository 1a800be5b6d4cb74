"""Model families for the scaling simulator: a one-knob width ladder, FLOPs, meta-device inputs.

Each family builds its model on the meta device at width step `k` (depth fixed) and counts
the FLOPs of one training step analytically (forward x 3: a matmul's backward is two
matmuls). Planning a 1024-rank mesh must stay fast, so depth is fixed and width grows.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

_EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@dataclass(frozen=True)
class WeatherMixerFamily:
    """The Jigsaw paper's WeatherMixer (examples/jigsaw_weathermixer.py), widened in steps of `unit`.

    Its configuration is the paper's artifact's (github.com/DeifiliaTo/Jigsaw_SC, cases/C4): 69
    fp32 fields on the 720 x 1440 grid (286 MB a sample), 1-D patches of 60 points (17,280
    tokens), 3 mixer blocks, channel MLP hidden = width, token MLP hidden = `spatial_fraction` x
    tokens (0.5 for its 1- and 2-GPU models, 1 for the 4-GPU one). The width knob is `dim`.
    """

    fields: int = 69
    lat: int = 720
    lon: int = 1440
    patch: int = 60
    depth: int = 3
    spatial_fraction: float = 0.5
    unit: int = 16
    dtype: torch.dtype = torch.float32
    first_guess: int = 270  # width step where the search starts on the first GPU count (dim 4320)
    name: str = "weather mixer"
    device: str = "a100-40gb"  # the paper's GPU, 4 to a node
    gpus: tuple[int, ...] = (1, 2, 4, 8)  # the paper's counts: 17,280 tokens leave little to split beyond
    # each rank is passed only its slice of the sample (Jigsaw's loaders read a rank's part): the planner chooses
    # the split, and no rank holds the whole fields
    input_placements: tuple | None = (None, None)

    def widths(self, k: int) -> dict:
        return dict(dim=k * self.unit, spatial_fraction=self.spatial_fraction)

    def build(self, k: int):
        """(model on meta, example inputs on meta) at width step k."""
        module = load_example("jigsaw_weathermixer")
        with torch.device("meta"):
            model = module.FieldLoss(fields=self.fields, lat=self.lat, lon=self.lon, patch=self.patch,
                                     depth=self.depth, **self.widths(k)).to(self.dtype)
            x = torch.empty(1, self.fields, self.lat, self.lon, dtype=self.dtype)
            target = torch.empty(1, self.lat, self.lon, self.fields, dtype=self.dtype)
        return model, (x, target)

    @property
    def tokens(self) -> int:
        return self.lat * self.lon // self.patch

    def sample_bytes(self) -> int:
        return self.fields * self.lat * self.lon * self.dtype.itemsize

    def train_flops(self, k: int) -> float:
        """Forward matmul and convolution FLOPs x 3: embedding, token and channel mixing, recovery, head."""
        d, t = k * self.unit, self.tokens
        token_hidden = int(t * self.spatial_fraction)
        block = 4 * d * t * token_hidden + 4 * t * d * d
        embed = 2 * t * d * (self.fields + 3) * self.patch
        recover = 2 * t * 2 * d * self.fields * self.patch
        head = 2 * self.lat * self.lon * 2 * self.fields * self.fields
        return 3.0 * (self.depth * block + embed + recover + head)

    def describe(self, k: int) -> str:
        return f"dim {k * self.unit}, tokens x {self.spatial_fraction:g}"


@dataclass(frozen=True)
class LlamaFamily:
    """Hugging Face Llama (MHA, SwiGLU, vocab 32k) at hidden = 128 k, one sample of `seq` tokens."""

    seq: int = 4096
    depth: int = 8
    vocab: int = 32000
    dtype: torch.dtype = torch.float32
    first_guess: int = 32
    name: str = "llama"
    device: str = "h100"
    gpus: tuple[int, ...] = (1, 2, 4, 8, 16, 64, 256, 1024)
    input_placements: tuple | None = None  # the token ids passed whole to every rank

    def widths(self, k: int) -> dict:
        h = 128 * k
        return dict(hidden=h, heads=k, ffn=256 * -(-8 * h // 3 // 256))

    def build(self, k: int):
        import transformers

        logging.getLogger("transformers").setLevel(logging.ERROR)
        w = self.widths(k)
        cfg = transformers.LlamaConfig(hidden_size=w["hidden"], intermediate_size=w["ffn"],
                                       num_hidden_layers=self.depth, num_attention_heads=w["heads"],
                                       num_key_value_heads=w["heads"], vocab_size=self.vocab,
                                       max_position_embeddings=self.seq, use_cache=False)
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(cfg).to(self.dtype)
            ids = torch.zeros(1, self.seq, dtype=torch.long)
        return model, (ids,)

    def train_flops(self, k: int) -> float:
        """6 N T for the matmul parameters (the LM head included, the embedding not) + attention."""
        w = self.widths(k)
        h, f = w["hidden"], w["ffn"]
        matmul_params = self.depth * (4 * h * h + 3 * h * f) + self.vocab * h
        return 6.0 * matmul_params * self.seq + 12.0 * self.depth * h * self.seq ** 2

    def describe(self, k: int) -> str:
        return f"hidden {self.widths(k)['hidden']}, depth {self.depth}"


def load_example(name: str):
    """The module examples/<name>.py (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"_examples_{name}", _EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
