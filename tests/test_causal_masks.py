"""A boolean attention mask computed from no input and exactly causal becomes SDPA's is_causal=True: as
transformers' eager run passes it, so the flash kernel runs and no S x S mask is held; any other mask stays."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from autojigsaw.capture import capture, causal_masks
from autojigsaw.capture.causal_masks import SDPA

from .hf_models import hf_model


def _attention(gm) -> list[tuple[bool, bool]]:
    """Per SDPA node: (is_causal, has a mask)."""
    out = []
    for n in gm.graph.nodes:
        if n.target is SDPA:
            kwargs = n.normalized_arguments(gm, normalize_to_only_use_kwargs=True).kwargs
            out.append((kwargs["is_causal"], kwargs["attn_mask"] is not None))
    return out


def _square_bool_nodes(gm, s: int) -> list[str]:
    return [n.name for n in gm.graph.nodes if isinstance(v := n.meta.get("val"), torch.Tensor)
            and v.dtype == torch.bool and tuple(v.shape[-2:]) == (s, s)]


class Masked(torch.nn.Module):
    """Self-attention with a boolean mask `mask_of(length)` built in forward, broadcast over a batch."""

    def __init__(self, mask_of):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)
        self.mask_of = mask_of

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, 8).permute(2, 0, 3, 1, 4)
        mask = self.mask_of(s).expand(b, 1, s, s)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()


def _positions(s):
    i = torch.arange(s)
    return (i[None, :] <= i[:, None])[None, None]


@pytest.mark.parametrize("name", ["llama", "gpt2", "mixtral"])
def test_transformers_causal_mask_becomes_the_flag(name):
    model, inputs = hf_model(name)
    captured = capture(model, inputs)
    assert _attention(captured.gm) == [(True, False)] * 2
    assert _square_bool_nodes(captured.gm, inputs[0].shape[1]) == []  # the mask's nodes are gone
    torch.testing.assert_close(captured.gm(*_feeds(captured, model, inputs))[0], model(*inputs).logits)


def _feeds(captured, model, inputs):
    """The placeholders' values, in the graph's order, for the model's state and these inputs."""
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    table = {**captured.params, **captured.buffers}
    users = iter(inputs)
    return [next(users) if n.name in captured.inputs else captured.constants.get(n.name, state.get(table[n.name]))
            for n in captured.gm.graph.nodes if n.op == "placeholder"]


def test_masks_checked_a_block_of_rows_at_a_time(monkeypatch):
    """Larger than WHOLE, the comparison of broadcast positions is computed in blocks, and still recognised."""
    monkeypatch.setattr(causal_masks, "WHOLE", 32)
    model, inputs = hf_model("llama")
    assert _attention(capture(model, inputs).gm) == [(True, False)] * 2
    model = Masked(_positions)
    assert _attention(capture(model, (torch.randn(3, 16, 32),)).gm) == [(True, False)]


def test_a_mask_too_large_to_check_stays(monkeypatch):
    monkeypatch.setattr(causal_masks, "WHOLE", 32)
    monkeypatch.setattr(causal_masks, "MOST", 16 * 16 - 1)
    assert _attention(capture(Masked(_positions), (torch.randn(3, 16, 32),)).gm) == [(False, True)]


@pytest.mark.parametrize("mask_of", [
    lambda s: torch.ones(s, s, dtype=torch.bool).tril(-1) | torch.eye(s, dtype=torch.bool).flip(0),  # not causal
    lambda s: torch.ones(s, s, dtype=torch.bool).triu(),  # the transpose
    lambda s: torch.ones(s, s, dtype=torch.bool).tril() & ~torch.ones(s, s, dtype=torch.bool).tril(-4),  # a window
], ids=["anti-diagonal", "upper", "window"])
def test_an_input_free_mask_that_is_not_causal_stays(mask_of):
    model = Masked(mask_of)
    x = torch.randn(2, 8, 32)
    captured = capture(model, (x,))
    assert _attention(captured.gm) == [(False, True)]
    torch.testing.assert_close(captured.gm(*_feeds(captured, model, (x,)))[0], model(x))


def test_an_input_free_causal_mask_becomes_the_flag_and_computes_the_same():
    model, x = Masked(lambda s: torch.ones(s, s, dtype=torch.bool).tril()), torch.randn(2, 8, 32)
    captured = capture(model, (x,))
    assert _attention(captured.gm) == [(True, False)]
    torch.testing.assert_close(captured.gm(*_feeds(captured, model, (x,)))[0], model(x))


def test_masks_from_inputs_stay():
    """A padding mask, or positions the caller passes (packed sequences), decide the mask at run time."""
    model, (ids,) = hf_model("llama")
    padding = torch.ones_like(ids)
    padding[0, -3:] = 0
    assert _attention(capture(model, (ids,), {"attention_mask": padding}).gm) == [(False, True)] * 2
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    assert _attention(capture(model, (ids,), {"position_ids": positions}).gm) == [(False, True)] * 2


def test_a_sliding_window_shorter_than_the_sequence_stays():
    import transformers

    cfg = transformers.MistralConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=128, sliding_window=4, use_cache=False)
    model = transformers.MistralForCausalLM(cfg)
    assert _attention(capture(model, (torch.randint(0, 128, (2, 16)),)).gm) == [(False, True)]


class _TwoMasks(Masked):
    """Two attentions, each with its own mask node expanded from one comparison of positions."""

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, 8).permute(2, 0, 3, 1, 4)
        causal = _positions(s)
        first = F.scaled_dot_product_attention(q, k, v, attn_mask=causal.expand(b, 1, s, s))
        return F.scaled_dot_product_attention(first, k, v, attn_mask=causal.expand(b, 4, s, s)).sum()


def test_causal_masks_sharing_their_nodes_are_erased_once():
    model, x = _TwoMasks(None), torch.randn(2, 8, 32)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="erase_node")  # fx warns when a node is erased twice
        captured = capture(model, (x,))
    assert _attention(captured.gm) == [(True, False)] * 2
    assert _square_bool_nodes(captured.gm, 8) == []
    torch.testing.assert_close(captured.gm(*_feeds(captured, model, (x,)))[0], model(x))
