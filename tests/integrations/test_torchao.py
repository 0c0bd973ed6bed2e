"""torchao's int8 weight-only quantization with a parallelized model. autoshard's quantize_
(integrations/torchao_quantize.py) gives the logits of the unsharded model quantized by torchao
(at 2 and 3 gloo ranks: row-parallel layers take each row's scale over the ranks), and refuses
other configs by name before changing anything. torchao's own quantize_ picks nn.Linear layers
(the sharded ones are, by class) and computes each row's scale from this rank's shard: refused
by the shard guard, naming torchao's function and autoshard's quantize_, before any layer is
replaced. A model quantized before planning is refused by plan and parallelize, naming the
quantized parameter's class, before anything is changed."""

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
        assert "autoshard.integrations.torchao_quantize.quantize_" in result["text"], result["text"]
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


def _quantized_logits():
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

    from autoshard.integrations.torchao_quantize import quantize_ as quantize_shards

    reference, unquantized, model = build("llama", seed=0), build("llama", seed=0), build("llama", seed=0)
    quantize_(reference, Int8WeightOnlyConfig())
    autoshard.parallelize(model)
    try:
        quantize_shards(model, Int8DynamicActivationInt8WeightConfig())
        other = None
    except ValueError as error:
        other = str(error)
    untouched = {type(m.weight).__name__ for m in model.modules() if isinstance(m, torch.nn.Linear)}
    quantize_shards(model, Int8WeightOnlyConfig())
    ids = torch.randint(3, 101, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got, plain = reference(ids).logits, model(ids).logits, unquantized(ids).logits
    return {"difference": float((got - want).abs().max()), "quantization": float((want - plain).abs().max()),
            "kinds": {type(m.weight).__name__ for m in model.modules() if isinstance(m, torch.nn.Linear)},
            "row_layers": sum(isinstance(m, autoshard.nn.RowParallelLinear) for m in model.modules()),
            "other": other, "untouched": untouched}


@pytest.mark.parametrize("world_size", [2, 3])
def test_autoshard_quantize_equals_torchao_on_the_unsharded_model(world_size):
    for rank, result in enumerate(run_on_ranks(_quantized_logits, world_size, timeout=600)):
        assert result["row_layers"] > 0, result  # the case of scales over the ranks is there
        assert result["kinds"] == {"Int8Tensor"}, result
        # Summation order apart; quantizing moves the logits far more than that.
        assert result["difference"] < 1e-5 and result["quantization"] > 100 * result["difference"], result
        assert result["other"] is not None and "Int8DynamicActivationInt8WeightConfig" in result["other"], result
        assert result["untouched"] == {"ShardParameter"}, result
