"""torch.distributed.pipelining with tensor-parallel stages: 4 gloo ranks on a 2 x 2
("pp", "tp") DeviceMesh, a float64 stack of pre-norm MLP blocks and a head split into pipeline
stages, each stage parallelized over "tp" (with mesh["tp"] or group=mesh.get_group("tp")).

With the stages' shapes inferred (no input_args/output_args), torch runs every stage but the
first once on uninitialised buffers to infer them; the input check compares their shapes only
there, and the pipeline's losses and every parameter gradient over two steps equal those of the
unsharded model in one process, as with the shapes declared up front, and with two stages per
rank (ScheduleInterleaved1F1B). Real batches that differ across the tensor-parallel ranks are
still refused: on the first stage, and on a later stage whose real inputs differ (its shape
inference having passed).
"""

from collections import OrderedDict

import pytest
import torch
from torch import nn

import autoshard
from autoshard.core.distributed import set_default_group
from autoshard.core.parallel_state import state_of
from gathered import gathered_grads
from multirank import RankFailure, run_on_ranks

WIDTH, HIDDEN, OUT = 16, 32, 8
BLOCKS = 4
ROWS, SEQ = 8, 4  # a batch: ROWS rows of SEQ tokens of WIDTH features
MICROBATCHES = 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(BLOCKS)], nn.Linear(WIDTH, OUT)).double()


def _batch(step: int, rank_offset: int = 0):
    g = torch.Generator().manual_seed(100 + 10 * step + rank_offset)
    return (torch.randn(ROWS, SEQ, WIDTH, dtype=torch.float64, generator=g),
            torch.randn(ROWS, SEQ, OUT, dtype=torch.float64, generator=g))


def _loss(output, target):
    return (output - target).square().mean()


def _stage_module(model: nn.Sequential, stage: int, stages: int) -> nn.Sequential:
    """The stage's slice of the model, under the model's own indices, so that its parameters'
    names are those of the unsharded model."""
    per = len(model) // stages
    last = len(model) if stage == stages - 1 else (stage + 1) * per
    return nn.Sequential(OrderedDict((str(i), model[i]) for i in range(stage * per, last)))


def _reference(step: int):
    """The unsharded model on the whole batch, as the schedule computes it: each microbatch's
    loss, and the gradients of their mean (torch's schedules scale by the microbatch count)."""
    model = _model()
    inputs, target = _batch(step)
    losses = [_loss(model(x), t) for x, t in zip(inputs.chunk(MICROBATCHES), target.chunk(MICROBATCHES))]
    (sum(losses) / MICROBATCHES).backward()
    return [loss.item() for loss in losses], {name: p.grad for name, p in model.named_parameters()}


def _pipeline(schedule: str, declared: bool, spelling: str, steps: int = 2):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleInterleaved1F1B

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp, pp_size = mesh.get_local_rank("pp"), mesh.size(0)
    per_rank = 2 if schedule == "interleaved" else 1
    stages = pp_size * per_rank
    model = _model()
    built, modules = [], []
    try:
        for stage_index in range(pp, stages, pp_size):  # torch's loop order: rank r holds r, r + pp_size, ...
            module = _stage_module(model, stage_index, stages)
            if spelling == "mesh":
                autoshard.parallelize(module, mesh=mesh["tp"])
            else:
                autoshard.parallelize(module, group=mesh.get_group("tp"))
            assert state_of(module).shards(), "nothing was sharded: the tensor-parallel checks would not run"
            shapes = {}
            if declared:
                microbatch = ROWS // MICROBATCHES
                width_out = OUT if stage_index == stages - 1 else WIDTH
                shapes = dict(
                    input_args=torch.empty(microbatch, SEQ, WIDTH, dtype=torch.float64,
                                           requires_grad=stage_index > 0),
                    output_args=torch.empty(microbatch, SEQ, width_out, dtype=torch.float64, requires_grad=True))
            built.append(PipelineStage(module, stage_index, stages, torch.device("cpu"),
                                       group=mesh.get_group("pp"), **shapes))
            modules.append(module)
        if schedule == "interleaved":
            runner = ScheduleInterleaved1F1B(built, n_microbatches=MICROBATCHES, loss_fn=_loss)
        else:
            runner = ScheduleGPipe(built[0], n_microbatches=MICROBATCHES, loss_fn=_loss)
        holds_first = any(s.is_first for s in built)
        holds_last = any(s.is_last for s in built)
        results = []
        for step in range(steps):
            for module in modules:
                module.zero_grad(set_to_none=True)
            inputs, target = _batch(step)
            losses = []
            runner.step(*([inputs] if holds_first else []), target=target if holds_last else None, losses=losses)
            want_losses, want_grads = _reference(step)
            grads = {}
            for module in modules:
                grads.update(gathered_grads(module))
            missing = sorted(name for name, g in grads.items() if g is None)
            worst = max((grads[name] - want_grads[name]).abs().max().item() for name in grads)
            loss_error = max((abs(a.item() - b) for a, b in zip(losses, want_losses)), default=0.0)
            results.append(dict(names=sorted(grads), missing=missing, grad_error=worst,
                                losses=len(losses), loss_error=loss_error))
        return results
    finally:
        set_default_group(None)  # the pool's next job expects the world


@pytest.mark.parametrize("schedule,declared,spelling", [
    ("gpipe", False, "mesh"),
    ("gpipe", False, "group"),
    ("gpipe", True, "group"),
    ("interleaved", False, "mesh"),
])
def test_pipeline_of_parallelized_stages_equals_unsharded(schedule, declared, spelling):
    per_rank = run_on_ranks(_pipeline, 4, schedule, declared, spelling, timeout=900)
    everything = {name for name, _ in _model().named_parameters()}
    for rank in range(4):
        assert len(per_rank[rank]) == 2
        for step, r in enumerate(per_rank[rank]):
            assert not r["missing"], (rank, step, r["missing"])
            assert r["grad_error"] < 1e-12, (rank, step, r)
            # The last stage's ranks (pp index 1) read the losses; the first stage's have none.
            assert r["losses"] == (MICROBATCHES if rank >= 2 else 0), (rank, step, r)
            assert r["loss_error"] < 1e-12, (rank, step, r)
    # The two pipeline ranks of one tensor-parallel index hold the whole model between them.
    for tp in range(2):
        held = set(per_rank[tp][0]["names"]) | set(per_rank[2 + tp][0]["names"])
        assert held == everything


def _later_stage_given_different_inputs():
    """Stage 0 is left whole (no tensor parallelism, so nothing checks it) and each of its ranks
    feeds its own batch; stage 1 is parallelized and receives different activations on its two
    tensor-parallel ranks. Forward only, with one microbatch: stage 0 finishes after its one send,
    and no rank waits on the one that raised."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp, tp = mesh.get_local_rank("pp"), mesh.get_local_rank("tp")
    module = _stage_module(_model(), pp, 2)
    try:
        if pp == 1:
            autoshard.parallelize(module, group=mesh.get_group("tp"))
        stage = PipelineStage(module, pp, 2, torch.device("cpu"), group=mesh.get_group("pp"))
        runner = ScheduleGPipe(stage, n_microbatches=1, loss_fn=_loss)
        inputs, target = _batch(0, rank_offset=tp)
        try:
            runner.eval(*([inputs] if pp == 0 else []), target=target if pp == 1 else None)
        except RuntimeError as error:  # torch wraps what a stage's real forward raises
            import traceback

            cause = error.__cause__
            return dict(refused=f"{type(cause).__name__}: {cause}", where=traceback.format_exc())
        return dict(refused=None, where=None)
    finally:
        set_default_group(None)


def test_later_stage_with_real_inputs_that_differ_is_refused():
    per_rank = run_on_ranks(_later_stage_given_different_inputs, 4, timeout=900)
    assert per_rank[0]["refused"] is None and per_rank[1]["refused"] is None
    for rank in (2, 3):
        text, where = per_rank[rank]["refused"], per_rank[rank]["where"]
        assert text is not None, f"rank {rank}: different real inputs were not refused"
        assert text.startswith("ValueError: autoshard: the tensor-parallel ranks [2, 3] were given different inputs"), text
        assert "holds different values" in text, text
        # Refused at the real forward, after the shape inference on empty buffers passed.
        assert "_forward_metadata_inference" not in where and "forward_one_chunk" in where, where


def _first_stage_given_different_batches():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp, tp = mesh.get_local_rank("pp"), mesh.get_local_rank("tp")
    module = _stage_module(_model(), pp, 2)
    try:
        autoshard.parallelize(module, mesh=mesh["tp"])
        stage = PipelineStage(module, pp, 2, torch.device("cpu"), group=mesh.get_group("pp"))
        runner = ScheduleGPipe(stage, n_microbatches=MICROBATCHES, loss_fn=_loss)
        inputs, target = _batch(0, rank_offset=tp)
        runner.step(*([inputs] if pp == 0 else []), target=target if pp == 1 else None)
    finally:
        set_default_group(None)


def test_first_stage_with_batches_that_differ_is_refused():
    # The first stage's ranks raise in the shape inference itself, whose inputs there are the
    # first microbatch; the last stage's ranks wait for shapes that never come, and the
    # pool of ranks is replaced.
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_first_stage_given_different_batches, 4, timeout=900)
    assert set(info.value.failures) == {0, 1}, info.value
    for rank in (0, 1):
        text = info.value.failures[rank]
        assert "ValueError: autoshard: the tensor-parallel ranks [0, 1] were given different inputs" in text, text
        assert "input 'args[0]'" in text and "holds different values" in text, text
