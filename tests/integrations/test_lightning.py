"""Lightning's Trainer and Fabric with autoshard's strategies (autoshard.integrations.lightning),
sequence and loss parallelism on (parallelize's defaults), at 2 gloo ranks: training is
interrupted by a checkpoint (trainer.save_checkpoint / fabric.save) and resumed by a new model,
optimizer and Trainer or Fabric (fit(ckpt_path=) / fabric.load). The weights at the end equal
those of the same Lightning script run uninterrupted on the unsharded model in one process with
torch.optim.AdamW, which holds only if the weights and the optimizer's moments and step counts came
back (a fresh AdamW moves each weight by about lr at its first step). The checkpoint also loads
into the unsharded model in one process with torch's DCP.

The model is float64, built so: Lightning refuses precision="64-true" with ModelParallelStrategy,
and its default ("32-true") converts nothing. The resumed run equals the uninterrupted one on the
same ranks up to float64 rounding. Against the unsharded run the bound is Hugging Face's loss,
computed in float32 even for a float64 model, whose sums the vocabulary shards take in another
order: AdamW's normalisation (m / sqrt(v)) makes those float32 roundings weight differences up to
5.4e-6 in these 4 steps, checked at 5e-5; a lost moment or step count moves weights by about
lr = 1e-2.
"""

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

lightning = pytest.importorskip("lightning")

import autoshard  # noqa: E402
from checks import error_text  # noqa: E402
from hf_models import from_config  # noqa: E402
from multirank import run_on_ranks  # noqa: E402

LLAMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, attention_dropout=0.0)
# 2 batches of 2 sequences of 8 tokens: an epoch is 2 optimizer steps.
TOKENS = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(5))
BATCH = 2
EXACT = dict(rtol=1e-12, atol=1e-14)
LOSS_IN_FLOAT32 = dict(rtol=0.0, atol=5e-5)


def _llama(seed: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return from_config(AutoModelForCausalLM, "llama", **LLAMA).double()


def _optimizer(kind: str, params):
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    if kind == "torch":
        return torch.optim.AdamW(params, **hyper)
    return autoshard.optim.AdamW(params, **hyper)


@contextlib.contextmanager
def _launched_env():
    """The variables of a rank that torchrun started (Lightning then launches no processes of
    its own), restored afterwards: the rank processes are reused, and Lightning's environment
    deletes WORLD_SIZE at teardown."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.get(k) for k in keys}
    if dist.is_initialized():
        rank = str(dist.get_rank())
        os.environ.update(RANK=rank, LOCAL_RANK=rank, NODE_RANK="0", WORLD_SIZE=str(dist.get_world_size()),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _check_equal(got, want, **tolerance):
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, **(tolerance or EXACT), msg=lambda m: f"{name}: {m}")


def _check_resumed(resumed, straight, unsharded):
    _check_equal(resumed, straight)
    _check_equal(resumed, unsharded, **LOSS_IN_FLOAT32)


def _full_weights(model):
    return {k: v.clone() for k, v in (autoshard.full_state_dict(model) if dist.is_initialized()
                                      else model.state_dict()).items()}


# -- Trainer ------------------------------------------------------------------------------------

class _LanguageModel(lightning.LightningModule):
    def __init__(self, seed: int, optimizer: str, parallel: bool):
        super().__init__()
        self.model = _llama(seed)
        self.optimizer_kind, self.parallel = optimizer, parallel

    def configure_model(self):
        if self.parallel:
            autoshard.parallelize(self.model)

    def training_step(self, batch, batch_index):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return _optimizer(self.optimizer_kind, self.parameters())


def _fit(module, epochs: int, strategy, ckpt_path=None):
    # use_distributed_sampler=False: Lightning would shuffle the training set under a distributed
    # sampler (identically on every tensor-parallel rank), and not in the one-process run.
    trainer = lightning.Trainer(accelerator="cpu", devices=dist.get_world_size() if dist.is_initialized() else 1,
                                strategy=strategy, max_epochs=epochs, use_distributed_sampler=False, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(TOKENS, batch_size=BATCH), ckpt_path=ckpt_path)
    return trainer


def _trainer_runs(optimizer: str, path: str):
    from autoshard.integrations.lightning import AutoshardStrategy

    with _launched_env():
        straight = _LanguageModel(1, optimizer, parallel=True)
        _fit(straight, 2, AutoshardStrategy())
        first = _LanguageModel(1, optimizer, parallel=True)
        trainer = _fit(first, 1, AutoshardStrategy())
        trainer.save_checkpoint(path)
        # Other initial weights: all that the second half starts from must come from the checkpoint.
        resumed = _LanguageModel(2, optimizer, parallel=True)
        trainer = _fit(resumed, 2, AutoshardStrategy(), ckpt_path=path)
        return (trainer.global_step, _full_weights(first.model), _full_weights(straight.model),
                _full_weights(resumed.model))


@pytest.mark.parametrize("optimizer", ["torch", "autoshard"])
def test_trainer_resumes_from_its_checkpoint_as_the_unsharded_run_continues(tmp_path, optimizer):
    path = str(tmp_path / "ckpt")
    module = _LanguageModel(1, "torch", parallel=False)
    trainer = _fit(module, 2, "auto")
    want = _full_weights(module.model)
    for steps, saved, straight, resumed in run_on_ranks(_trainer_runs, 2, optimizer, path, timeout=300):
        assert steps == trainer.global_step == 4
        _check_resumed(resumed, straight, want)
    # Lightning's layout (the LightningModule's state dict under "state_dict"), read by torch's DCP
    # into the plain model: the weights the first epoch ended with.
    plain = _llama(3)
    state = {"state_dict": {f"model.{k}": v for k, v in plain.state_dict().items()}}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    _check_equal({k[len("model."):]: v for k, v in state["state_dict"].items()}, saved)


# -- Fabric -------------------------------------------------------------------------------------

def _fabric_steps(seed: int, optimizer: str, strategy, until: int, load=None, save=None):
    """The same script for every run: set up, optionally load, train to step `until`,
    optionally save; the model's whole weights after."""
    fabric = lightning.Fabric(accelerator="cpu", devices=dist.get_world_size() if dist.is_initialized() else 1,
                              strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(_llama(seed))
    opt = fabric.setup_optimizers(_optimizer(optimizer, model.parameters()))
    state = {"model": model, "optimizer": opt, "step": 0}
    if load:
        fabric.load(load, state)
    batches = list(torch.utils.data.DataLoader(TOKENS, batch_size=BATCH)) * 2
    for step in range(state["step"], until):
        ids = batches[step]
        fabric.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
    state["step"] = until
    if save:
        fabric.save(save, state)
    return _full_weights(model.module)


def _fabric_runs(optimizer: str, path: str):
    from autoshard.integrations.lightning import AutoshardFabricStrategy

    with _launched_env():
        straight = _fabric_steps(1, optimizer, AutoshardFabricStrategy(), 4)
        saved = _fabric_steps(1, optimizer, AutoshardFabricStrategy(), 2, save=path)
        return saved, straight, _fabric_steps(2, optimizer, AutoshardFabricStrategy(), 4, load=path)


@pytest.mark.parametrize("optimizer", ["torch", "autoshard"])
def test_fabric_load_resumes_as_the_unsharded_run_continues(tmp_path, optimizer):
    path = str(tmp_path / "ckpt")
    want = _fabric_steps(1, "torch", "auto", 4)
    for saved, straight, resumed in run_on_ranks(_fabric_runs, 2, optimizer, path, timeout=300):
        _check_resumed(resumed, straight, want)
    plain = _llama(3)
    state = {"model": plain.state_dict()}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    _check_equal(state["model"], saved)


# -- misuse -------------------------------------------------------------------------------------

def test_checkpoints_of_whole_tensors_are_refused_naming_the_alternatives():
    from autoshard.integrations.lightning import AutoshardFabricStrategy, AutoshardStrategy

    for strategy in (AutoshardStrategy, AutoshardFabricStrategy):
        text = error_text(lambda: strategy(save_distributed_checkpoint=False))
        assert f"{strategy.__name__}(save_distributed_checkpoint=False)" in text
        assert "autoshard.full_state_dict(model)" in text and "no_dist=True" in text


def _misuse(directory: str):
    from autoshard.integrations.lightning import AutoshardFabricStrategy, AutoshardStrategy

    with _launched_env():
        # configure_model that parallelizes nothing: every rank would train its own copy.
        whole = error_text(lambda: _fit(_LanguageModel(1, "torch", parallel=False), 1, AutoshardStrategy()))
        fabric = lightning.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=AutoshardFabricStrategy())
        fabric.launch()
        model = fabric.setup_module(_llama(1))
        opt = fabric.setup_optimizers(_optimizer("torch", model.parameters()))
        no_model = error_text(lambda: fabric.save(os.path.join(directory, "ckpt"), {"optimizer": opt}))
        file = os.path.join(directory, "whole.pt")
        if dist.get_rank() == 0:
            torch.save({"model": _llama(1).state_dict()}, file)
        dist.barrier()
        from_file = error_text(lambda: fabric.load(file, {"model": model, "optimizer": opt}))
        unparallelized = lightning.Fabric(accelerator="cpu", devices=dist.get_world_size(),
                                          strategy=AutoshardFabricStrategy(parallelize_fn=lambda module, mesh: module))
        unparallelized.launch()
        left_whole = error_text(lambda: unparallelized.setup_module(_llama(1)))
        return whole, no_model, from_file, left_whole


def test_misuse_is_refused_naming_the_alternative(tmp_path):
    for whole, no_model, from_file, left_whole in run_on_ranks(_misuse, 2, str(tmp_path), timeout=300):
        assert "AutoshardStrategy" in whole and "autoshard.parallelize(self.model)" in whole
        assert "configure_model" in whole and "ModelParallelStrategy" in whole
        assert "no model parallelized by autoshard" in no_model and "state={'model': model" in no_model
        assert "no sharded checkpoint" in from_file and "model.load_state_dict" in from_file
        assert "parallelize_fn must call autoshard.parallelize" in left_whole
