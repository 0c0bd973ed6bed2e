"""A parallelized model against the unsharded one: full gradients gathered for comparison, and
forward and backward compared with the collectives the plan predicts."""

from autoshard.core.parallel_state import state_of
from autoshard.state.unsharded import gather_full


def gathered_grads(model):
    """Every parameter's full gradient, by the model's own names (each rank's local grads
    gathered at their places, as full_state_dict does for values; None where there is none)."""
    shards = state_of(model).shards()
    grads = {}
    for name, p in model.named_parameters():
        if id(p) in shards and p.grad is not None:
            spec, group = shards[id(p)]
            grads[name] = gather_full(p.grad, spec, group)
        else:
            grads[name] = p.grad
    return grads


def gathered_params(model):
    """Every parameter's full value, by the model's own names (as gathered_grads)."""
    shards = state_of(model).shards()
    return {name: gather_full(p.detach(), *shards[id(p)]) if id(p) in shards else p.detach()
            for name, p in model.named_parameters()}


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


def nonzero_counts(counter) -> dict:
    """The collectives a CommCounter saw at least once: {kind: count}."""
    return {k: v for k, v in counter.counts.items() if v}


def forward_backward_as_planned(model, reference, plan, run, rtol: float, atol: float):
    """`run(m)`, the output of the parallelized `model` and of the unsharded `reference`, compared;
    then backward through both from the same random weights (seed 2) on the output. The
    collectives counted in forward and in backward must be those `plan` predicts; returns them."""
    import torch

    import autoshard

    with autoshard.CommCounter() as forward:
        got = run(model)
    want = run(reference)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    assert nonzero_counts(forward) == plan.collectives("forward"), (nonzero_counts(forward),
                                                                      plan.collectives("forward"))
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(2))
    with autoshard.CommCounter() as backward:
        (got * weights).sum().backward()
    (want * weights).sum().backward()
    assert nonzero_counts(backward) == plan.collectives("backward"), (nonzero_counts(backward),
                                                                        plan.collectives("backward"), str(plan))
    return nonzero_counts(forward), nonzero_counts(backward)


def sgd_step_as_unsharded(model, reference, rtol: float, atol: float) -> None:
    """One SGD step (lr 0.1) on both, from the gradients they hold; then the parallelized
    model's full state dict must equal the unsharded one's, name by name."""
    import torch

    import autoshard

    for m in (model, reference):
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    got, want = autoshard.full_state_dict(model), reference.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def parallelized_and_stepped(model, reference, x, rtol: float, atol: float):
    """`model` planned on `x` for the world and parallelized; its forward and backward on `x`
    against `reference`'s with the collectives the plan predicts (forward_backward_as_planned),
    then one SGD step as unsharded. Returns (plan, forward counts, backward counts)."""
    import torch.distributed as dist

    import autoshard

    plan = autoshard.plan(model, world_size=dist.get_world_size(), example_inputs=(x,))
    autoshard.parallelize(model, plan)
    forward, backward = forward_backward_as_planned(model, reference, plan, lambda m: m(x), rtol=rtol, atol=atol)
    sgd_step_as_unsharded(model, reference, rtol=rtol, atol=atol)
    return plan, forward, backward
