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
    """WeatherMixer (examples/mixer_model.py) on a fixed sample, widened in steps of `unit`.

    The paper (arXiv 2507.05753) and its talk give the sample (~400 MB, global 0.25-degree ERA5)
    and the parameter counts (1.06 B on one GPU, 2.57 B on four); its widths, depth and patch
    size could not be found here, so these are assumptions: 96 fp32 channels on a 720 x 1440
    grid (398 MB), 16 x 16 patches (4,050 tokens), depth 8, token MLP hidden = width, channel
    MLP hidden = 4 x width. Replace them when the paper's configuration is known.
    """

    channels: int = 96
    lat: int = 720
    lon: int = 1440
    patch: int = 16
    depth: int = 8
    unit: int = 128
    dtype: torch.dtype = torch.float32
    first_guess: int = 32  # width step where the search starts on the first GPU count
    name: str = "weather mixer"

    def widths(self, k: int) -> dict:
        w = k * self.unit
        return dict(dim=w, token_hidden=w, channel_hidden=4 * w)

    def build(self, k: int):
        """(model on meta, example inputs on meta) at width step k."""
        module = _load_example("mixer_model")
        with torch.device("meta"):
            model = module.WeatherMixer(self.channels, self.lat, self.lon, self.patch,
                                        depth=self.depth, **self.widths(k)).to(self.dtype)
            x = torch.empty(1, self.channels, self.lat, self.lon, dtype=self.dtype)
        return model, (x,)

    @property
    def tokens(self) -> int:
        return (self.lat // self.patch) * (self.lon // self.patch)

    def sample_bytes(self) -> int:
        return self.channels * self.lat * self.lon * self.dtype.itemsize

    def train_flops(self, k: int) -> float:
        """Forward matmul FLOPs x 3: embedding, token mixing, channel mixing, head."""
        w, t, pix = self.widths(k), self.tokens, self.channels * self.patch ** 2
        block = 4 * w["dim"] * t * w["token_hidden"] + 4 * t * w["dim"] * w["channel_hidden"]
        return 3.0 * (self.depth * block + 4 * t * pix * w["dim"])

    def describe(self, k: int) -> str:
        w = self.widths(k)
        return f"dim {w['dim']}, depth {self.depth}"


@dataclass(frozen=True)
class LlamaFamily:
    """Hugging Face Llama (MHA, SwiGLU, vocab 32k) at hidden = 128 k, one sample of `seq` tokens."""

    seq: int = 4096
    depth: int = 8
    vocab: int = 32000
    dtype: torch.dtype = torch.float32
    first_guess: int = 32
    name: str = "llama"

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


def _load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"_examples_{name}", _EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
