"""`import autoshard` leaves torch as it found it: no function of torch's modules, and no method of
their classes, is replaced (tests run in a fresh interpreter, since pytest has imported autoshard).
torch's clipping and GradScaler are rerouted while a parallelized model lives, and given back
after the last one is gone."""

import gc
import subprocess
import sys
import textwrap

import pytest
import torch

from multirank import run_on_ranks

# The torch modules importing autoshard loads: imported before the snapshot, so that what torch
# does as it imports its own modules (registering types, marking globals safe) is not counted.
_TORCH_MODULES = textwrap.dedent('''
    import sys
    import autoshard, autoshard.integrations  # noqa: F401
    print(" ".join(sorted(name for name in sys.modules if name == "torch" or name.startswith("torch."))))
''')

_SNAPSHOT = textwrap.dedent('''
    import importlib, inspect, sys, types
    import torch
    for name in sys.argv[1:]:
        importlib.import_module(name)

    def snapshot():
        seen = {}
        for name, module in list(sys.modules.items()):
            if not (name == "torch" or name.startswith("torch.")) or module is None:
                continue
            for attr, value in list(vars(module).items()):
                if isinstance(value, types.ModuleType):
                    continue
                seen[f"{name}.{attr}"] = id(value)
                if inspect.isclass(value) and value.__module__ == name:
                    for member, item in list(vars(value).items()):
                        seen[f"{name}.{attr}.{member}"] = id(item)
        return seen

    before = snapshot()
    import autoshard  # noqa: F401
    import autoshard.integrations  # noqa: F401
    after = snapshot()
    changed = sorted(k for k in before if k in after and after[k] != before[k])
    removed = sorted(k for k in before if k not in after)
    print(f"{len(before)} names; changed: {changed}; removed: {removed}")
    sys.exit(1 if changed or removed else 0)
''')


def _torch_modules():
    result = subprocess.run([sys.executable, "-c", _TORCH_MODULES], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.split()


def test_import_autoshard_replaces_nothing_in_torch():
    result = subprocess.run([sys.executable, "-c", _SNAPSHOT, *_torch_modules()], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "names; changed: []; removed: []" in result.stdout, result.stdout


def test_the_snapshot_sees_a_replaced_method():
    """The check can fail: a method replaced at import is reported."""
    replacing = _SNAPSHOT.replace("import autoshard  # noqa: F401",
                                  "torch.amp.GradScaler._unscale_grads_ = lambda *a: None")
    result = subprocess.run([sys.executable, "-c", replacing, "torch", "torch.amp.grad_scaler"], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 1 and "torch.amp.grad_scaler.GradScaler._unscale_grads_" in result.stdout, \
        result.stdout + result.stderr[-3000:]


def _while_a_model_lives():
    from torch.nn.utils import clip_grad

    import autoshard
    from autoshard.runtime import torch_patches

    gc.collect()  # this worker's earlier jobs' models, freed but in reference cycles
    originals = (clip_grad._get_total_norm, clip_grad._clip_grads_with_norm_, torch.amp.GradScaler._unscale_grads_)
    before = torch_patches.installed()
    models = [torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 8)) for _ in range(2)]
    for model in models:
        autoshard.parallelize(model, example_inputs=(torch.randn(2, 8),))
    del model
    during = torch_patches.installed()
    models.pop()
    gc.collect()
    one_left = torch_patches.installed()
    models.clear()
    gc.collect()
    after = (clip_grad._get_total_norm, clip_grad._clip_grads_with_norm_, torch.amp.GradScaler._unscale_grads_)
    return {"before": before, "during": during, "one_left": one_left, "after": torch_patches.installed(),
            "restored": all(a is b for a, b in zip(after, originals))}


@pytest.mark.parametrize("world_size", [2])
def test_torch_is_rerouted_only_while_a_parallelized_model_lives(world_size):
    for result in run_on_ranks(_while_a_model_lives, world_size):
        assert result == {"before": False, "during": True, "one_left": True, "after": False, "restored": True}, result
