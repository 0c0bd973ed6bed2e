"""Multi-head latent attention's kv_a_proj, whose output gradient the plan sums in a forward hook
where the replicated layer returns it: a module swapped in after parallelize (or the hook removed)
would leave its readers' gradients partial, and is refused at the next forward."""

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

import autoshard
from multirank import run_on_ranks


def _mla():
    torch.manual_seed(0)
    config = AutoConfig.for_model("deepseek_v3", vocab_size=101, hidden_size=48, intermediate_size=70,
                                  num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=6,
                                  q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
                                  v_head_dim=8, first_k_dense_replace=1)
    return AutoModelForCausalLM.from_config(config)


def _swap_after_parallelize(how):
    model = _mla()
    ids = torch.randint(1, 101, (2, 7), generator=torch.Generator().manual_seed(1))
    autoshard.parallelize(model, example_inputs={"input_ids": ids})
    plan = autoshard.core.parallel_state.state_of(model).plan
    assert [r.module for r in plan.summed_outputs] == ["model.layers.0.self_attn.kv_a_proj_with_mqa"]
    model(input_ids=ids).logits.sum().backward()  # as parallelize left it: runs
    attention = model.model.layers[0].self_attn
    if how == "replaced":
        old = attention.kv_a_proj_with_mqa
        fresh = nn.Linear(old.in_features, old.out_features, bias=old.bias is not None)
        fresh.load_state_dict(old.state_dict())
        attention.kv_a_proj_with_mqa = fresh
    else:
        attention.kv_a_proj_with_mqa._forward_hooks.clear()
    try:
        model(input_ids=ids)
    except RuntimeError as error:
        return str(error)
    return None


@pytest.mark.parametrize("how", ["replaced", "hook_removed"])
def test_a_summed_output_module_changed_after_parallelize_is_refused(how):
    for message in run_on_ranks(_swap_after_parallelize, 2, how):
        assert message is not None and "'model.layers.0.self_attn.kv_a_proj_with_mqa' was replaced" in message
