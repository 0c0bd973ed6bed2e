"""What autoshard relies on of torch.distributed.pipelining: recognising the forward a
``PipelineStage`` runs to infer its stage's shapes.

A ``PipelineStage`` built without ``input_args``/``output_args`` infers them at its schedule's
first step, in ``_forward_metadata_inference`` (torch 2.13): every stage but the first runs its
module once on tensors made from the shapes the previous stage sent, with
``torch.empty_strided``, whose memory is left uninitialised and so differs from rank to rank,
then a backward from them to infer the gradients' shapes. Only the shapes of what that forward
computes are kept. The first stage runs it on detached copies of the first microbatch, real
values like those of any other forward.

Nothing here imports torch.distributed.pipelining: a process that never imported it runs no
stage, and looking it up in ``sys.modules`` costs nothing at each forward.
"""

import sys

_STAGE_MODULE = "torch.distributed.pipelining.stage"
_INFERENCE = "_forward_metadata_inference"
_STACK_DEPTH = 64  # frames searched above the caller: a parallelized module may sit deep in a stage


def inferring_shapes_from_empty_inputs(depth: int = 1) -> bool:
    """Whether the caller, `depth` frames up, runs inside the shape inference of a pipeline stage
    that is not the first, whose inputs are uninitialised buffers (values differ across ranks
    by construction; their shapes are those the stage will receive)."""
    if _STAGE_MODULE not in sys.modules:
        return False
    frame = sys._getframe(depth + 1)
    for _ in range(_STACK_DEPTH):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == _INFERENCE and frame.f_globals.get("__name__") == _STAGE_MODULE:
            stage = frame.f_locals.get("self")
            return not getattr(stage, "is_first", False)
        frame = frame.f_back
    return False
