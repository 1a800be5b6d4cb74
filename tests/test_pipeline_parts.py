"""The parts of pipeline parallelism that need no processes: the program cut into stages, schedules replayed.

A cut program's stages, run one after another on the model's own weights, give the model's loss and
every gradient; the values between stages are what a later stage reads and cannot remake (masks and
rotary tables are recomputed, not sent). The replay of PyTorch's schedules gives the textbook step
times and activation counts (Narayanan et al. 2021, arXiv 2104.04473: 1F1B's bubble (p - 1)(F + B),
interleaved's divided by v; GPipe holds every microbatch, 1F1B p - s on stage s).
"""

import pytest
import torch
import transformers as tf

from autojigsaw.capture import capture
from autojigsaw.capture.stages import cut, layer_stack
from autojigsaw.cost_model.schedule import SCHEDULES, StageTimes, schedule_name, simulate


def _model(name: str, layers: int):
    torch.manual_seed(0)
    if name == "llama":
        cfg = tf.LlamaConfig(num_hidden_layers=layers, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=64, use_cache=False)
        return tf.LlamaForCausalLM(cfg)
    cfg = tf.GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=64, n_positions=32, use_cache=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return tf.GPT2LMHeadModel(cfg)


def _run_stages(model, programs, inputs):
    """The stages' graphs run in order on the model's parameters and buffers: the last one's outputs."""
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    values = inputs
    for program in programs:
        c, feeds, given = program.captured, [], iter(values)
        for node in c.gm.graph.nodes:
            if node.op != "placeholder":
                continue
            feeds.append(params[c.params[node.name]] if node.name in c.params
                         else c.constants[node.name] if node.name in c.constants
                         else buffers[c.buffers[node.name]] if node.name in c.buffers else next(given))
        values = c.gm(*feeds)
    return values


@pytest.mark.parametrize("name,starts", [("llama", [0, 2, 3]), ("gpt2", [0, 2])])
def test_stages_run_one_after_another_give_the_models_loss_and_gradients(name, starts):
    model = _model(name, 5 if name == "llama" else 4)
    ids = torch.randint(0, 64, (2, 12))
    programs = cut(capture(model, (ids,), {"labels": ids}), starts)
    loss = _run_stages(model, programs, [ids, ids])[0]
    grads = torch.autograd.grad(loss, list(model.parameters()))
    ref = model(ids, labels=ids).loss
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    assert torch.equal(loss, ref)
    assert all(torch.allclose(g, r, rtol=0, atol=1e-6) for g, r in zip(grads, ref_grads))
    assert [p.layers[0] for p in programs] == [layer_stack(programs[0].captured)[0]] + [
        p.layers[0] for p in programs[1:]]


def test_masks_and_rotary_tables_are_remade_by_each_stage_not_sent():
    model = _model("llama", 4)
    ids = torch.randint(0, 64, (2, 12))
    programs = cut(capture(model, (ids,), {"labels": ids}), [0, 1, 3])
    for p in programs[:-1]:
        assert len(p.sends) == 2 and p.sends[0] == "labels", p.sends  # the labels and the residual stream
    tied = cut(capture(_model("gpt2", 2), (ids,), {"labels": ids}), [0, 1])
    assert "transformer.wte.weight" in set(tied[0].captured.params.values()) & set(tied[1].captured.params.values())


def test_cuts_that_cannot_be_are_refused_by_name():
    model = _model("llama", 3)
    ids = torch.randint(0, 64, (2, 8))
    captured = capture(model, (ids,), {"labels": ids})
    with pytest.raises(ValueError, match="must begin at 0 and rise within the 3 layers"):
        cut(captured, [0, 3])
    with pytest.raises(ValueError, match="has none: drop the pipe axis"):
        cut(capture(torch.nn.Linear(4, 4), (torch.randn(2, 4),)), [0])


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4)])
def test_replayed_schedules_give_the_textbook_bubbles(p, m):
    f, b = 1.0, 2.0
    one = simulate("1F1B", p, 1, m, [StageTimes(f, b)] * p, saved=[1.0] * p)
    assert one.step_time == pytest.approx((m + p - 1) * (f + b))
    assert one.in_flight == tuple(min(m, p - s) for s in range(p))
    gpipe = simulate("gpipe", p, 1, m, [StageTimes(f, b)] * p, saved=[1.0] * p)
    assert gpipe.step_time == pytest.approx((m + p - 1) * (f + b)) and gpipe.in_flight == (m,) * p
    v = 2
    inter = simulate("interleaved", p, v, m, [StageTimes(f / v, b / v)] * (p * v))
    assert inter.step_time == pytest.approx(m * (f + b) + (p - 1) * (f + b) / v)
    zb = simulate("zero-bubble", p, 2, m, [StageTimes(f / 2, b / 2, b / 4)] * (2 * p))
    assert zb.bubble < inter.bubble < one.bubble


def test_a_hop_between_ranks_costs_the_send_where_a_stage_waits_for_it():
    quiet = simulate("1F1B", 2, 1, 4, [StageTimes(1.0, 2.0)] * 2)
    slow = simulate("1F1B", 2, 1, 4, [StageTimes(1.0, 2.0, 0.0, 0.5)] * 2)
    # worked by hand: stage 1's first forward waits one hop; stage 0's backward of microbatch 0 one more,
    # its later backwards wait for stage 1's, which waited for their forwards' hop: 4 hops in all
    assert quiet.step_time == pytest.approx(15.0) and slow.step_time == pytest.approx(15.0 + 4 * 0.5)


def test_schedules_are_named_as_pytorch_names_them():
    for name, cls in SCHEDULES.items():
        assert schedule_name(cls) == name and schedule_name(name.upper()) == name
    with pytest.raises(ValueError, match="pipeline_schedule='pipedream'"):
        schedule_name("pipedream")
