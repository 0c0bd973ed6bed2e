"""load_pretrained() against transformers' own from_pretrained of the same checkpoint: models
built on meta and parallelized over 2 and 3 gloo ranks load GPT-2, Llama (grouped-query
attention), BERT and GPT-BigCode (one KV head fused beside the query heads) checkpoints written by save_pretrained in several files, and give the
same logits and the same full state dict; bad input is refused before anything changes."""

import json
import os
import shutil
import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

import autoshard
from checks import expect_errors
from hf_models import MASKED_LM, build
from multirank import run_on_ranks

KINDS = ("gpt2", "llama", "bert", "gpt_bigcode")
IDS = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(5))


def _reference(kind: str, path: str):
    cls = AutoModelForMaskedLM if kind in MASKED_LM else AutoModelForCausalLM
    return cls.from_pretrained(path, attn_implementation="eager").float().eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> a directory written by save_pretrained, in several files."""
    root = tmp_path_factory.mktemp("pretrained")
    dirs = {}
    for kind in KINDS:
        path = str(root / kind)
        build(kind, seed=11).save_pretrained(path, max_shard_size="20KB")
        files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
        assert len(files) > 3 and "model.safetensors.index.json" in os.listdir(path), files
        dirs[kind] = path
    return dirs


def _compare(kind: str, model: nn.Module, path: str) -> None:
    reference = _reference(kind, path)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=IDS).logits, reference(input_ids=IDS).logits,
                                   rtol=1e-5, atol=1e-5)
    got, want = autoshard.full_state_dict(model), reference.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    # Buffers the checkpoint does not hold (rotary inv_freq, position_ids) are computed.
    buffers = dict(reference.named_buffers())
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, buffers[name]), name


def _load_on_meta(kind: str, path: str):
    model = build(kind, device="meta")
    autoshard.parallelize(model)
    params = list(model.parameters())
    autoshard.load_pretrained(model, path, progress=False)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(b.device.type == "cpu" for b in model.buffers())
    # The same Parameter objects: an optimizer built before loading keeps working.
    assert all(a is b for a, b in zip(params, model.parameters()))
    return model


def _check_loads(dirs: dict) -> dict:
    sharded = {}
    for kind in KINDS:
        model = _load_on_meta(kind, dirs[kind])
        _compare(kind, model, dirs[kind])
        sharded[kind] = sorted({type(m).__name__ for m in model.modules() if hasattr(m, "shard_specs")})
        # A model already materialized (other weights) is filled in place.
        model = build(kind, seed=3)
        autoshard.parallelize(model)
        autoshard.load_pretrained(model, dirs[kind], progress=False)
        _compare(kind, model, dirs[kind])
    return sharded


@pytest.mark.parametrize("world_size", [2, 3])
def test_equals_from_pretrained(checkpoints, world_size):
    sharded = run_on_ranks(_check_loads, world_size, checkpoints, timeout=600)[0]
    for kind in KINDS:
        assert {"ColumnParallelLinear", "RowParallelLinear"} <= set(sharded[kind]), (kind, sharded[kind])


def _step_on_mesh(path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = build("gpt2", device="meta")
    try:
        autoshard.parallelize(model, mesh=mesh)
        opt = autoshard.optim.SGD(model.parameters(), lr=0.5)  # built on the meta parameters
        autoshard.load_pretrained(model, path, progress=False)
        reference = _reference("gpt2", path)
        ids = torch.randint(0, 101, (4, 9), generator=torch.Generator().manual_seed(6))
        half = ids.chunk(2)[mesh.get_local_rank("dp")]  # each replica takes half the batch
        model(input_ids=half, labels=half).loss.backward()
        opt.step()
        reference(input_ids=ids, labels=ids).loss.backward()
        torch.optim.SGD(reference.parameters(), lr=0.5).step()
        got, want = autoshard.full_state_dict(model), reference.state_dict()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    finally:
        autoshard.core.distributed.set_default_group(None)  # the pool's next job expects the world


def test_mesh_gradients_average_after_loading(checkpoints):
    # Loading gives the meta parameters storage; the data-parallel gradient averaging that
    # parallelize set up on them must still run, and the optimizer must step the loaded ones.
    run_on_ranks(_step_on_mesh, 4, checkpoints["gpt2"], timeout=600)


def _check_single_file(path: str, kind: str, directory: str) -> None:
    model = _load_on_meta(kind, path)
    _compare(kind, model, directory)


def test_single_file_and_base_model_checkpoint(tmp_path):
    # A one-file checkpoint of the bare GPT2Model: names lack the "transformer." prefix of
    # the model with a head, and the tied output head comes from the token embedding.
    base = tmp_path / "base"
    build("gpt2", seed=12).transformer.save_pretrained(base)
    file = base / "model.safetensors"
    assert not any(k.startswith("transformer.") for k in load_file(file))
    run_on_ranks(_check_single_file, 2, str(file), "gpt2", str(base))


def test_legacy_layernorm_names(tmp_path):
    # Older BERT checkpoints call LayerNorm parameters gamma and beta.
    legacy = tmp_path / "legacy"
    build("bert", seed=13).save_pretrained(legacy)
    tensors = load_file(legacy / "model.safetensors")
    renamed = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
               for k, v in tensors.items()}
    assert any(k.endswith("LayerNorm.gamma") for k in renamed)
    save_file(renamed, legacy / "model.safetensors", metadata={"format": "pt"})
    run_on_ranks(_check_single_file, 2, str(legacy), "bert", str(legacy))


def _meta_gpt2():
    model = build("gpt2", device="meta")
    return model, {n for n, p in model.named_parameters() if p.device.type == "meta"}


def test_bad_input_names_the_file_or_argument(checkpoints, tmp_path):
    gpt2, llama = checkpoints["gpt2"], checkpoints["llama"]
    model, on_meta = _meta_gpt2()
    wider = tmp_path / "wider"
    build("gpt2", seed=1, vocab_size=103).save_pretrained(wider)
    broken = tmp_path / "broken"
    shutil.copytree(gpt2, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    os.remove(broken / first)
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = str(tmp_path / "nowhere")
    expect_errors([
        (lambda: autoshard.load_pretrained(model, missing), FileNotFoundError, [missing]),
        (lambda: autoshard.load_pretrained(model, empty), FileNotFoundError, [str(empty), "model.safetensors.index.json"]),
        (lambda: autoshard.load_pretrained(model, broken), FileNotFoundError, [first, "model.safetensors.index.json"]),
        (lambda: autoshard.load_pretrained(model, llama), ValueError,
         [llama, "missing", "'transformer.h.0.attn.c_attn.weight'", "unexpected", "'model.norm.weight'"]),
        (lambda: autoshard.load_pretrained(model, wider), ValueError,
         ["'transformer.wte.weight'", str(wider), "[103, 60]", "[101, 60]"]),
        (lambda: autoshard.load_pretrained(model, gpt2, dtype=torch.int32), TypeError, ["dtype"]),
        (lambda: autoshard.load_pretrained(model, gpt2, device="gpu7"), ValueError, ["device", "gpu7"]),
        (lambda: autoshard.load_pretrained(model, gpt2, strict="yes"), TypeError, ["strict"]),
        (lambda: autoshard.load_pretrained("model", gpt2), TypeError, ["model"]),
        (lambda: autoshard.load_pretrained(model, 3), TypeError, ["path"]),
    ])
    # Nothing was touched: every parameter is still on meta.
    assert {n for n, p in model.named_parameters() if p.device.type == "meta"} == on_meta


def test_strict_false_loads_what_matches(checkpoints, tmp_path):
    # Without the final LayerNorm, and with a tensor the model lacks.
    tensors = {}
    for file in os.listdir(checkpoints["gpt2"]):
        if file.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(checkpoints["gpt2"], file)))
    kept = tensors.pop("transformer.ln_f.weight")
    tensors["extra.weight"] = torch.ones(3)
    save_file(tensors, tmp_path / "partial.safetensors")
    model = build("gpt2", seed=2)
    with torch.no_grad():
        model.transformer.ln_f.weight.fill_(2.0)  # LayerNorm weights start as ones, as saved
    before = model.transformer.ln_f.weight.clone()
    with pytest.raises(ValueError, match="ln_f.weight.*extra.weight"):
        autoshard.load_pretrained(model, tmp_path / "partial.safetensors")
    autoshard.load_pretrained(model, tmp_path / "partial.safetensors", strict=False, progress=False)
    assert torch.equal(model.transformer.ln_f.weight, before) and not torch.equal(before, kept)
    assert torch.equal(model.transformer.h[1].mlp.c_fc.weight, tensors["transformer.h.1.mlp.c_fc.weight"])


class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4), persistent=False)


def test_buffer_nothing_computes_is_an_error(tmp_path):
    save_file(WithBuffer().state_dict(), tmp_path / "plain.safetensors")
    with torch.device("meta"):
        model = WithBuffer()
    with pytest.raises(RuntimeError, match="'scale'.*meta"):
        autoshard.load_pretrained(model, tmp_path / "plain.safetensors", progress=False)


def test_dtype_casts_what_meta_tensors_get(checkpoints):
    model = build("llama", device="meta")
    autoshard.load_pretrained(model, checkpoints["llama"], dtype=torch.bfloat16)
    reference = _reference("llama", checkpoints["llama"])
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32  # computed buffers keep their own
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value.to(torch.bfloat16)), name


def test_meta_tensor_held_weakly_is_refused_before_anything_changes(checkpoints):
    model = build("gpt2", device="meta")
    held = weakref.ref(model.transformer.ln_f.weight)
    with pytest.raises(RuntimeError, match="transformer.ln_f.weight.*weak references"):
        autoshard.load_pretrained(model, checkpoints["gpt2"], progress=False)
    assert held() is not None and all(p.device.type == "meta" for p in model.parameters())
