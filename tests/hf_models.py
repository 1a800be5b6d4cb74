"""Tiny Hugging Face models (built from configs, no downloads) and inputs for them."""

from __future__ import annotations

import logging

import torch

from .moe_models import custom_routing

logging.getLogger("transformers").setLevel(logging.ERROR)

NAMES = ("gpt2", "llama", "bert", "vit")
# imported by the server the test pools fork their workers from (conftest.py), once, not by each worker (1-2 s each)
WORKER_PRELOAD = ("transformers", "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2")


def hf_model(name: str, seed: int = 0, dropout: float = 0.0):
    """(model, example inputs) of a 2-layer, 64-wide `name` with seeded weights."""
    import transformers

    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(_BUILDERS)}")
    torch.manual_seed(seed)
    ids = torch.randint(0, 128, (2, 16))
    return _BUILDERS[name](transformers, ids, dropout)


def _gpt2(tf, ids, dropout):
    cfg = tf.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                        use_cache=False, bos_token_id=0, eos_token_id=0, resid_pdrop=dropout,
                        embd_pdrop=dropout, attn_pdrop=dropout)
    return tf.GPT2LMHeadModel(cfg), (ids,)


def _llama(tf, ids, dropout):
    cfg = tf.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                         use_cache=False, attention_dropout=dropout)
    return tf.LlamaForCausalLM(cfg), (ids,)


def _bert(tf, ids, dropout):
    cfg = tf.BertConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                        num_attention_heads=4, vocab_size=128, hidden_dropout_prob=dropout,
                        attention_probs_dropout_prob=dropout)
    return tf.BertModel(cfg), (ids,)


def _vit(tf, ids, dropout):
    cfg = tf.ViTConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                       num_attention_heads=4, image_size=32, patch_size=8,
                       hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return tf.ViTModel(cfg), (torch.randn(2, 3, 32, 32),)


def _resnet(tf, ids, dropout):
    """BatchNorm, a 3x3 stride-2 max pool, bottlenecks, a global average pool."""
    cfg = tf.ResNetConfig(embedding_size=8, hidden_sizes=[16, 32], depths=[1, 1], num_labels=5,
                          downsample_in_bottleneck=True)
    return tf.ResNetForImageClassification(cfg), (torch.randn(1, 3, 32, 32),)


def _convnextv2(tf, ids, dropout):
    """7x7 depthwise convolutions, channels-last LayerNorm, global response norm."""
    cfg = tf.ConvNextV2Config(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], patch_size=2, num_labels=5,
                              drop_path_rate=dropout)
    return tf.ConvNextV2ForImageClassification(cfg), (torch.randn(1, 3, 32, 32),)


def _segformer(tf, ids, dropout):
    """A segmentation model: overlapping patch convolutions, Mix-FFN's depthwise conv."""
    cfg = tf.SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
                             num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2],
                             decoder_hidden_size=16, num_labels=3, hidden_dropout_prob=dropout,
                             classifier_dropout_prob=dropout, drop_path_rate=dropout)
    return tf.SegformerForSemanticSegmentation(cfg), (torch.randn(1, 3, 32, 32),)


def _mixtral(tf, ids, dropout, routing=lambda model: model):
    """transformers' default grouped_mm experts (or, routed by `routing`, another variant)."""
    cfg = tf.MixtralConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                           num_local_experts=8, num_experts_per_tok=2, use_cache=False)
    return routing(tf.MixtralForCausalLM(cfg)), (ids[:1, :8],)


def _hubert(tf, ids, dropout):
    """Speech: convolutions over samples; transformers' SpecAugment and LayerDrop defaults."""
    cfg = tf.HubertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                          conv_dim=(8, 8), conv_stride=(2, 2), conv_kernel=(4, 3), num_conv_pos_embeddings=4,
                          num_conv_pos_embedding_groups=2, vocab_size=12, feat_extract_norm="layer",
                          hidden_dropout=dropout)
    return tf.HubertForCTC(cfg), (torch.randn(1, 64),)


def _t5(tf, ids, dropout):
    """An encoder-decoder with transformers' default use_cache=True; give it labels= as well."""
    cfg = tf.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                      dropout_rate=dropout, decoder_start_token_id=0)
    return tf.T5ForConditionalGeneration(cfg), (ids % 64,)


def _swin(tf, ids, dropout):
    """Shifted windows: torch.roll over the token grid, a relative position bias gathered by index."""
    cfg = tf.SwinConfig(image_size=32, patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4,
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, drop_path_rate=dropout,
                        num_labels=5)
    return tf.SwinForImageClassification(cfg), (torch.randn(2, 3, 32, 32),)


def _groupvit(tf, ids, dropout):
    """Grouping by Gumbel-softmax: torch.distributions noise, a hard (straight-through) argmax."""
    cfg = tf.GroupViTVisionConfig(hidden_size=32, intermediate_size=64, depths=[1, 1], num_group_tokens=[8, 0],
                                  num_output_groups=[8, 8], num_attention_heads=4, image_size=32, patch_size=8,
                                  hidden_dropout_prob=dropout, attention_dropout=dropout)
    return tf.GroupViTVisionModel(cfg), (torch.randn(2, 3, 32, 32),)


def _patchtst(tf, ids, dropout):
    """A time-series transformer: patches cut by Tensor.unfold along the time axis."""
    cfg = tf.PatchTSTConfig(num_input_channels=3, context_length=32, patch_length=8, patch_stride=8, d_model=32,
                            num_attention_heads=4, num_hidden_layers=2, ffn_dim=64, prediction_length=8,
                            dropout=dropout, attention_dropout=dropout, ff_dropout=dropout, path_dropout=dropout)
    return tf.PatchTSTForPrediction(cfg), (torch.randn(2, 32, 3),)


_BUILDERS = {
    "gpt2": _gpt2, "llama": _llama, "bert": _bert, "vit": _vit, "resnet": _resnet, "convnextv2": _convnextv2,
    "segformer": _segformer, "mixtral": _mixtral,
    # its searchsorted variant, whose grouped matmuls are planned one by one (tests/test_moe.py)
    "mixtral-custom-routing": lambda tf, ids, dropout: _mixtral(tf, ids, dropout, custom_routing),
    "hubert": _hubert, "t5": _t5, "swin": _swin, "groupvit": _groupvit, "patchtst": _patchtst,
}


def batch_of_8(name: str):
    """`name` in training mode with a seeded batch of 8 (of 64 tokens, or of its image size)."""
    model, inputs = hf_model(name)
    g, x = torch.Generator().manual_seed(1), inputs[0]
    x = torch.randint(0, 128, (8, 64), generator=g) if x.dtype == torch.long else torch.randn(8, *x.shape[1:],
                                                                                               generator=g)
    return model.train(), (x,)
