"""transformers.Trainer with a parallelized model under torchrun (autoshard.integrations.Trainer),
against the same tiny Llama trained by transformers' own Trainer in one process: the same
training losses and gradient norms step by step (clipping active), the same evaluation loss
and predicted logits (on the mesh, the second replica's last evaluation batch is padding that
must be dropped), the same count of input tokens, the same weights after training; save_model
writes a directory from_pretrained loads into the unsharded model; a checkpoint taken
mid-training resumes exactly (optimizer state and schedule included). Refusals name the fix.

Ranks are real gloo processes given torchrun's environment variables, which accelerate reads.
At 2 and 3 ranks the model is tensor-parallel over all of them; on the 2 x 2 ("dp", "tp") mesh
each "dp" replica gets its own batches, so the one-process run takes both replicas' batches
in one (twice the per-device batch).
"""

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
import transformers
from transformers import AutoModelForCausalLM, TrainingArguments, default_data_collator

import autoshard
import autoshard.integrations
from autoshard.core.distributed import set_default_group
from hf_models import build
from checks import error_text
from multirank import run_on_ranks

STEPS, SAVE_AT, BATCH, EVAL_BATCH = 4, 2, 2, 2


class _Tokens(torch.utils.data.Dataset):
    """`n` random sequences of 8 tokens of the tiny Llama's vocabulary (101), as their own labels."""

    def __init__(self, n: int, seed: int):
        self.ids = torch.randint(0, 101, (n, 8), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


@contextlib.contextmanager
def _torchrun_env():
    """torchrun's environment for this rank (none outside a process group), and accelerate's
    process-wide state started afresh from it and cleared after (the rank processes are reused)."""
    from accelerate.state import AcceleratorState

    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.get(k) for k in keys}
    if dist.is_initialized():
        rank, world = str(dist.get_rank()), str(dist.get_world_size())
        os.environ.update(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=world,
                          MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        set_default_group(None)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _arguments(output_dir: str, batch: int, **extra) -> TrainingArguments:
    return TrainingArguments(**extra, output_dir=output_dir, per_device_train_batch_size=batch,
                             per_device_eval_batch_size=EVAL_BATCH, max_steps=STEPS, learning_rate=5e-3,
                             weight_decay=0.1, max_grad_norm=0.5, logging_steps=1, save_strategy="steps",
                             save_steps=SAVE_AT, eval_strategy="no", report_to="none", use_cpu=True, seed=0,
                             disable_tqdm=True, optim="adamw_torch", include_num_input_tokens_seen="all")


def _model(layout, seed):
    model = build("llama", seed=seed)
    if layout == "tp":
        autoshard.parallelize(model)
    elif layout == "mesh":
        from torch.distributed.device_mesh import init_device_mesh

        autoshard.parallelize(model, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
    return model


def _weights(model, layout):
    return autoshard.full_state_dict(model) if layout else {k: v.clone() for k, v in model.state_dict().items()}


def _logged(trainer, first_step=1):
    return [(h["step"], h["loss"], h["grad_norm"]) for h in trainer.state.log_history
            if "loss" in h and h["step"] >= first_step]


def _train(output_dir: str, layout=None, batch: int = BATCH):
    """Trains, evaluates, saves and resumes the tiny Llama: with transformers' Trainer in one
    process (layout None), or parallelized ("tp" or "mesh") with autoshard's."""
    trainer_class = autoshard.integrations.Trainer if layout else transformers.Trainer
    train, held_out = _Tokens(16, seed=1), _Tokens(6, seed=2)
    with _torchrun_env():
        model = _model(layout, seed=0)
        trainer = trainer_class(model=model, args=_arguments(output_dir, batch), train_dataset=train,
                                eval_dataset=held_out, data_collator=default_data_collator)
        trainer.train()
        predicted = trainer.predict(held_out)  # whole logits, gathered from the ranks' vocabulary shards
        result = dict(logged=_logged(trainer), eval_loss=trainer.evaluate()["eval_loss"],
                      weights=_weights(model, layout), tokens=trainer.state.num_input_tokens_seen,
                      predictions=torch.as_tensor(predicted.predictions), test_loss=predicted.metrics["test_loss"])
        if layout is None:  # the reference: what the parallelized runs must equal
            return result
        final = os.path.join(output_dir, "final")
        trainer.save_model(final)
        if dist.get_rank() == 0:
            loaded = AutoModelForCausalLM.from_pretrained(final).state_dict()
            result["loaded"] = max(float((loaded[k] - v).abs().max()) for k, v in result["weights"].items())
            result["files"] = sorted(os.listdir(os.path.join(output_dir, f"checkpoint-{SAVE_AT}")))

        # Resumed from the mid-training checkpoint, into a model of other weights.
        model = _model(layout, seed=5)
        trainer = trainer_class(model=model, args=_arguments(output_dir + "-resumed", batch), train_dataset=train,
                                eval_dataset=held_out, data_collator=default_data_collator)
        trainer.train(resume_from_checkpoint=os.path.join(output_dir, f"checkpoint-{SAVE_AT}"))
        result.update(resumed_logged=_logged(trainer, SAVE_AT + 1), resumed_weights=_weights(model, layout))
    return result


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """transformers' Trainer in this process: at the per-device batch, and at twice it (the 2 x 2
    mesh's two replicas). Each parallelized run's resumed half is compared with its own
    uninterrupted run."""
    return {batch: _train(str(tmp_path_factory.mktemp(f"one{batch}")), None, batch) for batch in (BATCH, 2 * BATCH)}


def _named(name):
    return lambda message: f"{name}: {message}"


def _assert_same(got, want, batch):
    assert [s for s, _, _ in got["logged"]] == list(range(1, STEPS + 1)), got["logged"]
    for (step, loss, norm), (_, want_loss, want_norm) in zip(got["logged"], want["logged"]):
        assert loss == pytest.approx(want_loss, rel=1e-5, abs=1e-5), (step, loss, want_loss)
        assert norm == pytest.approx(want_norm, rel=1e-4, abs=1e-5), (step, norm, want_norm)
    assert max(n for _, _, n in want["logged"]) > 0.5, "clipping should act at max_grad_norm=0.5"
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-5, abs=1e-5)
    assert got["tokens"] == want["tokens"] == STEPS * batch * 8, (got["tokens"], want["tokens"])
    assert got["test_loss"] == pytest.approx(want["test_loss"], rel=1e-5, abs=1e-5)
    assert got["predictions"].shape == want["predictions"].shape == (len(_Tokens(6, 2)), 8, 101)
    torch.testing.assert_close(got["predictions"], want["predictions"], rtol=1e-4, atol=1e-4)
    assert got["weights"].keys() == want["weights"].keys()
    for name, value in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, rtol=1e-4, atol=1e-4, msg=_named(name))
    resumed, uninterrupted = got["resumed_logged"], got["logged"][SAVE_AT:]
    assert [s for s, _, _ in resumed] == [s for s, _, _ in uninterrupted], resumed
    assert [l for _, l, _ in resumed] == pytest.approx([l for _, l, _ in uninterrupted], rel=1e-6, abs=1e-6)
    for name, value in got["weights"].items():
        torch.testing.assert_close(got["resumed_weights"][name], value, rtol=1e-6, atol=1e-7, msg=_named(name))


def _assert_saved(ranks, world_size):
    """save_model's directory loads into the unsharded model with the trained weights; the
    checkpoint holds each rank's own optimizer state and no optimizer.pt (one rank's shards)."""
    assert ranks[0]["loaded"] < 1e-6, "from_pretrained of save_model's directory differs from the trained weights"
    files = ranks[0]["files"]
    assert all(f"optimizer.rank{r}-of-{world_size}.pt" in files for r in range(world_size)), files
    assert "optimizer.pt" not in files and "model.safetensors" in files, files


@pytest.mark.parametrize("world_size", [2, 3])
def test_tensor_parallel_trainer_equals_one_process(world_size, one_process, tmp_path):
    ranks = run_on_ranks(_train, world_size, str(tmp_path / "run"), "tp", timeout=600)
    for got in ranks:
        _assert_same(got, one_process[BATCH], BATCH)
    _assert_saved(ranks, world_size)


def test_mesh_trainer_equals_one_process(one_process, tmp_path):
    ranks = run_on_ranks(_train, 4, str(tmp_path / "run"), "mesh", timeout=600)
    for got in ranks:
        _assert_same(got, one_process[2 * BATCH], 2 * BATCH)
    _assert_saved(ranks, 4)


def _refusals(output_dir: str):
    """At 2 ranks, tensor-parallel over both: transformers' own Trainer (accelerate wraps the
    model in DDP over the tensor-parallel ranks), FSDP asked of autoshard's Trainer, and a
    checkpoint whose optimizer state 3 ranks saved."""
    with _torchrun_env():
        make = lambda cls, **kw: cls(model=_model("tp", seed=0), args=_arguments(output_dir, BATCH, **kw),
                                     train_dataset=_Tokens(16, seed=1), data_collator=default_data_collator)
        errors = dict(plain=error_text(lambda: make(transformers.Trainer).train()),
                      fsdp=error_text(lambda: make(autoshard.integrations.Trainer, fsdp="full_shard")))
        trainer = make(autoshard.integrations.Trainer)
        trainer.create_optimizer_and_scheduler(num_training_steps=STEPS)
        checkpoint = os.path.join(output_dir, f"saved-by-3-{dist.get_rank()}")
        os.makedirs(checkpoint)
        torch.save({}, os.path.join(checkpoint, "optimizer.rank0-of-3.pt"))
        errors["resume"] = error_text(lambda: trainer._load_optimizer_and_scheduler(checkpoint))
    return errors


def test_refusals_name_what_to_do(tmp_path):
    for errors in run_on_ranks(_refusals, 2, str(tmp_path), timeout=600):
        text = errors["plain"]
        assert "DistributedDataParallel spans ranks [0, 1]" in text, text
        assert "autoshard.integrations.Trainer" in text and "from autoshard.integrations import Trainer" in text, text
        text = errors["fsdp"]
        assert "TrainingArguments(fsdp=...)" in text and "leave it unset" in text, text
        text = errors["resume"]
        assert "holds no optimizer state for rank" in text and "['optimizer.rank0-of-3.pt']" in text, text
        assert "resumes at the number of ranks and the ('dp', 'tp') layout that saved it" in text, text


def _layouts_the_trainer_cannot_feed(output_dir: str):
    """At 4 ranks: parallelize over the mesh's "tp" groups only (nothing would average the two
    replicas' gradients, which the Trainer would give different batches), and a mesh whose "tp"
    groups are not runs of consecutive ranks (accelerate's data loaders give those one batch)."""
    from torch.distributed.device_mesh import init_device_mesh

    def trainer_of(mesh):
        model = build("llama", seed=0)
        autoshard.parallelize(model, mesh=mesh)
        autoshard.integrations.Trainer(model=model, args=_arguments(output_dir, BATCH),
                                       train_dataset=_Tokens(16, seed=1), data_collator=default_data_collator)

    with _torchrun_env():
        part = error_text(lambda: trainer_of(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]))
        strided = error_text(lambda: trainer_of(init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))))
    return part, strided


def test_layouts_the_trainer_cannot_feed_are_refused(tmp_path):
    for part, strided in run_on_ranks(_layouts_the_trainer_cannot_feed, 4, str(tmp_path / "layout"), timeout=600):
        assert "autoshard.integrations.Trainer: the model is tensor-parallel over 2 ranks" in part, part
        assert "torchrun started 4 processes" in part and "parallelize(model, mesh=mesh)" in part, part
        assert "the tensor-parallel ranks must be consecutive" in strided, strided
        assert "mesh_dim_names=('dp', 'tp')" in strided, strided
