"""SavedTensorCounter against what autograd is known to save for a few ops."""

import pytest
import torch

import autoshard


def test_counts_each_storage_once_and_the_largest_tensor():
    x = torch.randn(8, 5, dtype=torch.float64, requires_grad=True)
    with autoshard.SavedTensorCounter() as saved:
        a = x.sin()  # saves x
        b = x[:2].cos()  # saves a view of x: the same storage
        c = a.exp()  # saves its result (8 x 5)
        (c.sum() + b.sum()).backward()
    assert saved.tensors == 3
    assert saved.bytes == 2 * 8 * 5 * 8  # x's storage and exp's result, once each
    assert saved.largest == 8 * 5 * 8


def test_ignored_parameters_leave_the_activations():
    torch.manual_seed(0)
    layer = torch.nn.Linear(6, 4)
    x = torch.randn(3, 6, requires_grad=True)
    with autoshard.SavedTensorCounter() as everything:
        layer(x).sum().backward()
    with autoshard.SavedTensorCounter(ignore=layer.parameters()) as activations:
        layer(x).sum().backward()
    # addmm saves its input and its weight; without the weight only the input remains.
    assert everything.bytes == (3 * 6 + 4 * 6) * 4
    assert activations.bytes == 3 * 6 * 4
    assert activations.largest == 3 * 6 * 4


def test_nothing_is_counted_outside_the_block():
    x = torch.randn(4, requires_grad=True)
    counter = autoshard.SavedTensorCounter()
    with counter:
        pass
    x.sin().sum().backward()
    assert counter.bytes == 0 and counter.tensors == 0 and counter.largest == 0


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="ignore must hold tensors, item 1 is int"):
        autoshard.SavedTensorCounter(ignore=[torch.zeros(1), 3])
    counter = autoshard.SavedTensorCounter()
    with counter:
        with pytest.raises(RuntimeError, match="already active"):
            counter.__enter__()
