"""Indexing with a list of consecutive integers, as the capture reads it (a slice): the same
values as torch's own indexing, and only such lists rewritten."""

import pytest
import torch

from autoshard.capture.index_lists import ConsecutiveIndexLists, _rewritten

X = torch.arange(2 * 3 * 8 * 4, dtype=torch.float32).reshape(2, 3, 8, 4)


@pytest.mark.parametrize("index", [
    (Ellipsis, [-2], slice(None)), (Ellipsis, [-1], slice(None)), (Ellipsis, [-3, -2, -1], slice(None)),
    (slice(None), slice(None), [0, 1, 2]), (slice(None), [1]), ([0],), (None, Ellipsis, [1, 2], None),
])
def test_consecutive_lists_give_torchs_values_as_a_slice(index):
    with ConsecutiveIndexLists():
        got = X[index]
    assert torch.equal(got, X[index])
    assert not got._is_view() and _rewritten(index, X.dim(), X.shape) is not None
    got.add_(1)  # a copy, as the list gives
    assert torch.equal(X, torch.arange(X.numel(), dtype=X.dtype).reshape(X.shape))


@pytest.mark.parametrize("index", [
    (Ellipsis, [-1, 0], slice(None)), (Ellipsis, [0, 2]), (Ellipsis, [2, 1]), ([0], [1]),
    (Ellipsis, torch.tensor([1, 2])), (Ellipsis, [True, False, True, False]), 1, (Ellipsis, 2), [],
])
def test_other_indices_are_left_to_torch(index):
    assert _rewritten(index, X.dim(), X.shape) is None
    with ConsecutiveIndexLists():
        got = X[index]
    assert torch.equal(got, X[index])


def test_a_list_past_the_end_still_raises():
    assert _rewritten((Ellipsis, [3, 4]), X.dim(), X.shape) is None  # a slice would clamp it to [3:4]
    with ConsecutiveIndexLists(), pytest.raises(IndexError):
        X[..., [3, 4]]
