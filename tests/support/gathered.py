"""Full gradients of a parallelized model, for comparison with the unsharded model's."""

from autoshard.model_state import state_of
from autoshard.state import gather_full


def gathered_grads(model):
    """Every parameter's full gradient, by the model's own names (each rank's local grads
    gathered at their places, as full_state_dict does for values)."""
    shards = state_of(model).shards()
    grads = {}
    for name, p in model.named_parameters():
        if id(p) in shards:
            spec, group = shards[id(p)]
            grads[name] = gather_full(p.grad, spec, group)
        else:
            grads[name] = p.grad
    return grads


def assert_equals_unsharded(model, reference, inputs: tuple, rtol: float, atol: float):
    """The parallelized `model` against the unsharded `reference` on `inputs`: outputs, then every
    parameter's gradient of the outputs' sum of squares. Returns the gathered gradients."""
    import torch

    want, got = reference(*inputs), model(*inputs)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    want.square().sum().backward()
    got.square().sum().backward()
    grads = gathered_grads(model)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    return grads
