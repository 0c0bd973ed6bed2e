"""torch.autocast(device_type=x.device.type) inside a forward: on meta, where autoshard plans,
the region opens as a CPU one while meta_autocast is active, and torch's own refusal of device
type "meta" is back once it is not. tests/conformance's own_idiom_autocast checks such a model
exact at 2 and 3 ranks."""

import pytest
import torch

from autoshard.inputs.meta_autocast import meta_autocast


def _attend(x):
    with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16):
        return torch.softmax(x @ x.transpose(-1, -2), dim=-1)


def test_autocast_on_meta_opens_while_active_only():
    x = torch.empty(2, 5, 8, device="meta")
    with pytest.raises(RuntimeError, match="meta"):
        _attend(x)
    with meta_autocast():
        with meta_autocast():  # nested (a dry run inside a plan) leaves it active
            assert _attend(x).shape == (2, 5, 5)
        assert _attend(x).shape == (2, 5, 5)
    with pytest.raises(RuntimeError, match="meta"):
        _attend(x)
    # Other devices keep their own autocast.
    with meta_autocast():
        assert _attend(torch.randn(2, 5, 8)).dtype == torch.bfloat16
