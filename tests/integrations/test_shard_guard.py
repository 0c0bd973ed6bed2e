"""The shard guard (python/autoshard/runtime/shard_guard.py), at 2 gloo ranks on a tiny Llama (vocabulary
101: 51 and 50 rows): an op outside autoshard that would compute with one rank's shard as the whole
tensor (a hand-written head, F.linear on a weight, a norm, indexing, an argmax of the vocabulary
shard of the logits) is refused with an error naming the op, the parameter and the caller; what
is exact on a piece (casts, arithmetic, torch.optim's step) runs; autoshard.local gives the piece
knowingly. (The model's own code reading its sharded parameters in its forward, as gpt-oss's
attention reads its sinks, runs: tests/integrations/test_dcp.py and the conformance matrix.)"""

import torch
import torch.nn.functional as F

import autoshard
from hf_models import build
from multirank import run_on_ranks


def _refused(call):
    try:
        call()
    except autoshard.ShardReadError as error:
        return str(error)
    return None


def _outside_reads() -> dict:
    reference, model = build("llama", seed=0).double(), build("llama", seed=0).double()
    autoshard.parallelize(model)
    ids = torch.randint(3, 101, (2, 7), generator=torch.Generator().manual_seed(1))
    hidden = model.model(ids).last_hidden_state
    up = model.model.layers[0].mlp.up_proj.weight
    refused = {
        "hand-written head": _refused(lambda: hidden @ model.lm_head.weight.T),
        "F.linear": _refused(lambda: F.linear(hidden, up)),
        "norm of a detached copy": _refused(lambda: up.detach().float().norm()),
        "row of the embedding": _refused(lambda: model.model.embed_tokens.weight[5]),
        "argmax of the logits shard": _refused(lambda: model(input_ids=ids, labels=ids).logits.argmax(-1)),
    }
    out = model(input_ids=ids, labels=ids)
    whole = autoshard.gather_logits(model, out.logits)
    with torch.no_grad():
        want = reference(input_ids=ids, labels=ids)
        piece = F.linear(reference.model(ids).last_hidden_state, autoshard.shard(reference.model.layers[0].mlp.up_proj
                                                                                  .weight, *_rank_world()))
        local = F.linear(hidden, autoshard.local(up))
    # Exact on a piece: casts and arithmetic keep a guarded shard; torch.optim steps it.
    scaled = (up.detach().float() * 2 + 1).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out.loss.backward()
    optimizer.step()
    return {"refused": refused, "argmax": torch.equal(whole.argmax(-1), want.logits.argmax(-1)),
            "local": float((local - piece).abs().max()), "scaled": type(scaled).__name__,
            "after step": type(up).__name__}


def _rank_world():
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def test_outside_reads_of_a_shard_are_refused_and_exact_uses_run():
    for rank, result in enumerate(run_on_ranks(_outside_reads, 2, timeout=600)):
        for what, text in result["refused"].items():
            assert text is not None, f"rank {rank}: {what} computed with one rank's shard, silently"
            assert "this rank's shard" in text and "test_shard_guard.py" in text and "autoshard.local" in text, text
        assert "matmul on lm_head.weight" in result["refused"]["hand-written head"]
        assert "linear on model.layers.0.mlp.up_proj.weight" in result["refused"]["F.linear"]
        assert "autoshard.gather_logits" in result["refused"]["argmax of the logits shard"]
        assert result["argmax"], "gathered logits give the unsharded model's argmax"
        assert result["local"] < 1e-12
        assert result["scaled"] == "ShardValue" and result["after step"] == "ShardParameter"
