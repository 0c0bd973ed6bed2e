"""ShardingPlan.memory against measurement on 2 and 4 gloo ranks, for a dense LM, a GQA LM, an
MoE, an encoder-decoder and a vision model: parameters, gradients and AdamW state against the
bytes of model.parameters(), their .grad and optimizer.state after one autoshard.optim.AdamW
step; activations against SavedTensorCounter in the same forward; the peak against the most
bytes of tensors held at once in a second step (the state, and what the step's ops hold at once:
CPU's max_memory_allocated, counted op by op). Peak RSS is returned beside them for the
printout, never asserted (a shared machine's RSS is noise at these sizes)."""

import pytest
import torch
import torch.distributed as dist
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageClassification,
                          AutoModelForSeq2SeqLM)
from transformers.utils import logging

import autoshard
from multirank import run_on_ranks
from live_tensor_bytes import LiveTensorBytes
from peak_memory import PeakMemory

logging.set_verbosity_error()

TOLERANCE = 0.10
LM = dict(vocab_size=101, hidden_size=48, intermediate_size=70, num_hidden_layers=2, attention_dropout=0.0)
ARCHITECTURES = {
    "dense": (AutoModelForCausalLM, "llama", dict(LM, num_attention_heads=6, num_key_value_heads=6)),
    "gqa": (AutoModelForCausalLM, "llama", dict(LM, num_attention_heads=6, num_key_value_heads=3)),
    # An FFN of 96: the grouped matmul's CPU kernel needs 16-byte aligned strides on every rank.
    "moe": (AutoModelForCausalLM, "mixtral", dict(LM, intermediate_size=96, num_attention_heads=6,
                                                  num_key_value_heads=3, num_local_experts=3, num_experts_per_tok=2)),
    "t5": (AutoModelForSeq2SeqLM, "t5", dict(vocab_size=101, d_model=48, d_kv=8, d_ff=70, num_layers=2,
                                              num_decoder_layers=2, num_heads=6, dropout_rate=0.0,
                                              decoder_start_token_id=0, pad_token_id=0)),
    "vit": (AutoModelForImageClassification, "vit", dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
                                                         intermediate_size=70, image_size=32, patch_size=8,
                                                         num_channels=3, num_labels=10, hidden_dropout_prob=0.0,
                                                         attention_probs_dropout_prob=0.0)),
}
BATCH, SEQ = 2, 24


def build(name: str, device="cpu"):
    auto, kind, values = ARCHITECTURES[name]
    config = AutoConfig.for_model(kind, **values)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    with torch.device(device):
        return auto.from_config(config).float()


def inputs(name: str):
    """One training batch, the same on every rank."""
    generator = torch.Generator().manual_seed(1)
    if name == "vit":
        return {"pixel_values": torch.randn(BATCH, 3, 32, 32, generator=generator),
                "labels": torch.randint(0, 10, (BATCH,), generator=generator)}
    ids = torch.randint(2, 101, (BATCH, SEQ), generator=generator)
    return {"input_ids": ids, "labels": ids.clone()}


def plan_inputs(name: str):
    """The batch without labels, as a plan is best made (the loss then goes over vocabulary
    shards where parallelize finds it can); T5 reads decoder ids in their place."""
    batch = inputs(name)
    labels = batch.pop("labels")
    if name == "t5":
        batch["decoder_input_ids"] = labels
    return batch


def _tensor_bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def measure_and_predict(name: str) -> dict:
    model = build(name)
    batch = inputs(name)
    plan = autoshard.plan(model, example_inputs=plan_inputs(name))
    predicted = plan.memory(batch)[dist.get_rank()]
    model = autoshard.parallelize(model, plan)
    model.train()
    optimizer = autoshard.optim.AdamW(model.parameters(), lr=1e-3)
    with PeakMemory() as rss:
        with autoshard.SavedTensorCounter(ignore=model.parameters()) as saved:
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
    params = list(model.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    measured = {"parameters": _tensor_bytes(params), "gradients": _tensor_bytes(p.grad for p in params),
                "optimizer": _tensor_bytes(state), "activations": saved.bytes}
    # A second step, the gradients kept from the first (zeroed in place) as the prediction
    # models it: the state held throughout, and the most the step's ops hold at once.
    optimizer.zero_grad(set_to_none=False)
    grads = [p.grad for p in params if p.grad is not None]
    held = params + grads + state + list(model.buffers())
    with LiveTensorBytes(existing=held + [t for t in batch.values() if isinstance(t, torch.Tensor)]) as live:
        model(**batch).loss.backward()
        optimizer.step()
    peak = _tensor_bytes(params) + _tensor_bytes(grads) + _tensor_bytes(state) + _tensor_bytes(model.buffers()) + live.peak
    return {"predicted": predicted, "measured": measured, "peak": peak, "rss": rss.added("RssAnon"),
            "loss_parallel": model.autoshard_state.loss_parallel.enabled}


def _close(predicted: int, measured: int) -> bool:
    return abs(predicted - measured) <= TOLERANCE * measured


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_prediction_within_ten_percent_of_measurement(name, world_size):
    results = run_on_ranks(measure_and_predict, world_size, name, timeout=300.0)
    for rank, result in enumerate(results):
        p, m = result["predicted"], result["measured"]
        rows = {key: (getattr(p, key), value) for key, value in m.items()}
        print(f"{name} N={world_size} rank {rank}: " + ", ".join(f"{k} {a}/{b}" for k, (a, b) in rows.items())
              + f", peak {p.peak}/{result['peak']} (RSS added {result['rss']}), "
              f"loss parallel {result['loss_parallel']}")
        for key, (predicted, measured) in rows.items():
            assert _close(predicted, measured), (name, world_size, rank, key, predicted, measured)
        # The peak is the measured components plus a transient on top, never below them.
        assert _close(p.peak - p.transient, sum(m.values()))
        assert p.peak >= sum(m.values()) * (1 - TOLERANCE)
        assert _close(p.peak, result["peak"]), (name, world_size, rank, p.peak, result["peak"])


def test_offline_prediction_equals_the_one_made_on_the_ranks():
    """A plan made on meta with world_size given predicts what the ranks predict for themselves."""
    model = build("gqa", device="meta")
    plan = autoshard.plan(model, world_size=2, example_inputs=plan_inputs("gqa"))
    offline = plan.memory(inputs("gqa"))
    online = [r["predicted"] for r in run_on_ranks(measure_and_predict, 2, "gqa", timeout=300.0)]
    assert offline.ranks == online
    assert not dist.is_initialized()  # the fake world it used is gone


def test_batch_and_seq_scale_the_example_inputs():
    model = build("dense", device="meta")
    plan = autoshard.plan(model, world_size=2)
    scaled = plan.memory(batch=3, seq=40)
    ids = torch.full((3, 40), 5)
    given = plan.memory({"input_ids": ids, "labels": ids})
    assert scaled.inputs == "input_ids (3, 40), labels (3, 40)"
    assert [r.activations for r in scaled.ranks] == [r.activations for r in given.ranks]
    small = plan.memory(batch=3, seq=20)
    assert all(s.activations < b.activations for s, b in zip(small.ranks, scaled.ranks))
    assert [r.model_state for r in small.ranks] == [r.model_state for r in scaled.ranks]


def test_optimizer_and_master_weights():
    model = build("dense", device="meta")
    plan = autoshard.plan(model, world_size=2)
    held = sum(plan.held_parameters(0).values())
    steps = len(plan.held_parameters(0))
    adamw = plan.memory(batch=1, seq=8)[0]
    assert (adamw.parameters, adamw.gradients, adamw.optimizer) == (4 * held, 4 * held, 8 * held + 4 * steps)
    bf16 = plan.memory(batch=1, seq=8, dtype=torch.bfloat16)[0]
    # bf16 weights and gradients, fp32 moments and an fp32 master: 2 + 2 + 12 bytes a parameter.
    assert (bf16.parameters, bf16.gradients, bf16.optimizer) == (2 * held, 2 * held, 12 * held + 4 * steps)
    no_master = plan.memory(batch=1, seq=8, dtype=torch.bfloat16, master_weights=False)[0]
    assert no_master.optimizer == 4 * held + 4 * steps
    sgd = plan.memory(batch=1, seq=8, optimizer="sgd")[0]
    assert sgd.optimizer == 4 * held
    assert plan.memory(batch=1, seq=8, optimizer=None)[0].optimizer == 0
    with pytest.raises(ValueError, match="optimizer must be one of"):
        plan.memory(optimizer="adam")
    with pytest.raises(ValueError, match="example_inputs or batch/seq"):
        plan.memory({"input_ids": torch.ones(1, 4, dtype=torch.long)}, batch=2)


def test_cli_prints_memory_per_rank_and_at_the_largest_world_size(capsys):
    from autoshard.__main__ import main

    assert main(["plan", "--model-type", "llama", "--world-size", "2", "--set", "num_hidden_layers=2",
                 "--set", "hidden_size=48", "--set", "intermediate_size=70", "--set", "num_attention_heads=6",
                 "--set", "num_key_value_heads=3", "--set", "vocab_size=101",
                 "--batch", "3", "--seq", "40", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "memory per rank at world size 2, inputs input_ids (3, 40), labels (3, 40), optimizer adamw, " \
           "dtype bfloat16" in out
    # 6 heads: every split layer stays split up to 6 ranks.
    assert "at 6 ranks, the largest world size" in out
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    help_text = capsys.readouterr().out
    for option in ("--batch", "--seq", "--optimizer", "--dtype", "--master-weights", "--no-memory"):
        assert option in help_text
