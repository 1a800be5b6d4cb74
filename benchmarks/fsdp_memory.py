"""FSDP's peak memory, predicted against measured: Hugging Face Llamas on data=2 (gloo, CPU).

Each model is parallelized on a 2-rank `data` mesh (FSDP2, one unit per decoder layer and a root
unit for the embedding, final norm and head), takes one Adam step, and the next step's peak is
measured with torch's MemTracker (tests/cost_checks.measure_step) beside the plan's prediction.

Run: python -m benchmarks.fsdp_memory
"""

from __future__ import annotations

import logging

import torch

from autojigsaw.testing.local_ranks import LocalRanks
from tests.cost_checks import measure_step

from .common import Report

# (layers, hidden, batch, sequence): weights most of the memory, then activations more of it
CASES = [(4, 256, 2, 32), (8, 256, 2, 32), (4, 128, 4, 128)]


class _Logits(torch.nn.Module):
    """The causal LM's logits (MemTracker's step squares and sums them)."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        return self.lm(ids).logits


def llama(layers: int, hidden: int, batch: int, seq: int):
    """A seeded Llama of `layers` x `hidden` (vocabulary 256) and a batch of ids."""
    import transformers as tf

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    return _Logits(tf.LlamaForCausalLM(cfg)), (torch.randint(0, 256, (batch, seq)),)


def main() -> Report:
    report = Report("fsdp_memory", "FSDP peak memory per rank, predicted and measured (data=2, fp32, Adam)")
    rows = []
    with LocalRanks(2) as pool:
        for case in CASES:
            r = pool.run(measure_step, llama, case, (2,), ("data",))[0]
            rows.append((*case, f"{r.predicted_peak / 2**20:.1f}", f"{r.peak / 2**20:.1f}", f"{r.memory_error:+.1%}"))
    report.table("Llama on data=2", rows, ["layers", "hidden", "batch", "sequence", "predicted MiB", "measured MiB",
                                           "error"])
    report.save()
    return report


if __name__ == "__main__":
    main()
