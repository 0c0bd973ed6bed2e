"""TRL's SFTTrainer and DPOTrainer on a parallelized tiny Llama (vocabulary 101 over 2 gloo ranks:
51 and 50 rows of the head), against the same trainers on the unsharded model in one process.

Both trainers compute log-probabilities with a fused LM head that reads the head's weight itself.
With autoshard's trainers (TRL's with AutoshardTrainerMixin) that head is computed over the
vocabulary shards: the same losses, entropies, token accuracies and weights step by step, and
save_model writes a directory from_pretrained loads. TRL's fused head on a parallelized model without
them is refused by the shard guard, naming the parameter and the caller, never silently computed."""

import os

import pytest
import torch
import torch.distributed as dist

import autoshard
from hf_models import build
from multirank import run_on_ranks
from .test_hf_trainer import _torchrun_env

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

STEPS, VOCAB = 3, 101


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t2"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1", unk_token="t2")


def _ids(n: int, length: int, seed: int):
    return torch.randint(3, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed)).tolist()


def _config(kind: str, output_dir: str):
    common = dict(output_dir=output_dir, per_device_train_batch_size=2, max_steps=STEPS, learning_rate=0.5,
                  logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0, optim="sgd",
                  disable_tqdm=True, bf16=False, fp16=False, max_length=12)
    if kind == "sft":
        return trl.SFTConfig(**common, packing=False)
    return trl.DPOConfig(**common)


def _dataset(kind: str):
    if kind == "sft":
        return datasets.Dataset.from_dict({"input_ids": _ids(6, 9, seed=1)})
    def text(ids, lead=""):  # completions end with the EOS word t1, so TRL adds none
        return [lead + " ".join(f"t{i}" for i in row) + (" t1" if lead else "") for row in ids]

    return datasets.Dataset.from_dict({"prompt": text(_ids(6, 4, seed=1)), "chosen": text(_ids(6, 4, seed=2), " "),
                                       "rejected": text(_ids(6, 4, seed=3), " ")})


def _metrics(trainer, names):
    return [{name: entry[name] for name in names if name in entry} for entry in trainer.state.log_history
            if "loss" in entry]


def _train(kind: str, output_dir: str, trainer_class=None, sharded: bool = True):
    """Trains the tiny Llama with TRL's `kind` trainer ("sft" or "dpo"): parallelized with the
    given trainer class under a process group, or unsharded with TRL's own in one process."""
    with _torchrun_env():
        model = build("llama", seed=0).train()
        extra = {}
        if kind == "dpo":
            reference = build("llama", seed=0).eval()
            if sharded:
                autoshard.parallelize(reference)
            extra["ref_model"] = reference
        if sharded:
            autoshard.parallelize(model)
        cls = trainer_class or (trl.SFTTrainer if kind == "sft" else trl.DPOTrainer)
        trainer = cls(model=model, args=_config(kind, output_dir), train_dataset=_dataset(kind),
                      processing_class=_tokenizer(), **extra)
        trainer.train()
        names = ("loss", "grad_norm", "entropy", "mean_token_accuracy") if kind == "sft" else ("grad_norm",
            "loss", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")
        result = {"metrics": _metrics(trainer, names),
                  "weights": autoshard.full_state_dict(model) if sharded else
                  {k: v.detach().clone() for k, v in model.state_dict().items()}}
        if sharded:
            final = os.path.join(output_dir, "final")
            trainer.save_model(final)
            dist.barrier()
            from transformers import AutoModelForCausalLM

            loaded = AutoModelForCausalLM.from_pretrained(final).state_dict()
            result["loaded"] = max(float((loaded[k] - v).abs().max()) for k, v in result["weights"].items())
        return result


def _autoshard_trainer(kind, output_dir):
    import autoshard.integrations as integrations

    return _train(kind, output_dir, integrations.SFTTrainer if kind == "sft" else integrations.DPOTrainer)


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_trl_trainer_with_the_fused_head_equals_the_unsharded_run(kind, tmp_path):
    reference = _train(kind, str(tmp_path / "reference"), sharded=False)
    assert len(reference["metrics"]) == STEPS
    results = run_on_ranks(_autoshard_trainer, 2, kind, str(tmp_path / "sharded"), timeout=900)
    for rank, result in enumerate(results):
        assert len(result["metrics"]) == STEPS, result["metrics"]
        for step, (want, got) in enumerate(zip(reference["metrics"], result["metrics"])):
            assert want.keys() == got.keys(), (want, got)
            for name in want:
                assert got[name] == pytest.approx(want[name], rel=1e-4, abs=1e-5), \
                    f"rank {rank}, step {step + 1}: {name} {got[name]} where one process gives {want[name]}"
        for name, want in reference["weights"].items():
            torch.testing.assert_close(result["weights"][name], want, rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"rank {rank}: {name}: {m}")
        assert result["loaded"] == 0.0
    # The weights moved: the comparison above is of trained weights, not of the initial ones.
    initial = build("llama", seed=0).state_dict()
    assert max(float((initial[k] - v).abs().max()) for k, v in reference["weights"].items()) > 1e-3


def _fused_head_read_by_trl_itself():
    """TRL's fused head added to a parallelized model by hand, with no autoshard trainer."""
    from trl.trainer.utils import add_fused_lm_head

    model = autoshard.parallelize(build("llama", seed=0))
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    ids = torch.tensor(_ids(2, 9, seed=1))
    try:
        model(input_ids=ids, labels=ids, fused_lm_head=True)
    except autoshard.ShardReadError as error:
        return str(error)
    return None


def test_a_fused_head_reading_the_shard_itself_is_refused():
    for rank, text in enumerate(run_on_ranks(_fused_head_read_by_trl_itself, 2, timeout=600)):
        assert text is not None, f"rank {rank}: TRL's fused head computed over a vocabulary shard"
        assert "lm_head.weight" in text and "this rank's shard" in text, text
        assert "trl" in text and "autoshard.integrations.SFTTrainer" in text, text  # the caller, and what to do
