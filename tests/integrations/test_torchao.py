"""torchao's quantize_ with a parallelized model, at 2 gloo ranks. Its int8 weight-only config
picks nn.Linear layers (the sharded Linear layers are ones by class) and computes each weight's
per-row scales itself, from this rank's shard: refused by the shard guard, naming torchao's
function, before any layer is replaced. A model quantized before planning is refused by plan and
parallelize, naming the quantized parameter's class, before anything is changed."""

import pytest
import torch

import autoshard
from hf_models import build
from multirank import run_on_ranks

torchao = pytest.importorskip("torchao")


def _quantize_after_parallelize():
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    reference, model = build("llama", seed=0), build("llama", seed=0)
    autoshard.parallelize(model)
    found = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    try:
        quantize_(model, Int8WeightOnlyConfig())
        text = None
    except autoshard.ShardReadError as error:
        text = str(error)
    ids = torch.randint(3, 101, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        unchanged = float((model(ids).logits - reference(ids).logits).abs().max())
    kinds = {type(module.weight).__name__ for module in model.modules() if isinstance(module, torch.nn.Linear)}
    return {"text": text, "found": len(found), "unchanged": unchanged, "kinds": kinds}


def test_quantize_after_parallelize_is_refused_where_it_reads_a_shard():
    for rank, result in enumerate(run_on_ranks(_quantize_after_parallelize, 2, timeout=600)):
        assert result["found"] > 0, "torchao would find no Linear layer to quantize, silently"
        assert result["text"] is not None, f"rank {rank}: torchao quantized a shard's scales as the whole row's"
        assert "torchao" in result["text"] and "this rank's shard" in result["text"], result["text"]
        assert result["kinds"] == {"ShardParameter"}, result["kinds"]  # no layer was replaced
        assert result["unchanged"] < 1e-5, result


def test_a_model_quantized_before_planning_is_refused_before_anything_changes():
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = build("llama", seed=0)
    quantize_(model, Int8WeightOnlyConfig())
    before = {name: type(p) for name, p in model.named_parameters()}
    for call in (lambda: autoshard.plan(model, world_size=2), lambda: autoshard.parallelize(model)):
        with pytest.raises(TypeError) as refused:
            call()
        text = str(refused.value)
        assert "torchao" in text and "q_proj.weight" in text and "quantize_" in text, text
    assert {name: type(p) for name, p in model.named_parameters()} == before
