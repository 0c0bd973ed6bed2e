"""Two models parallelized in one process over different process groups train side by side:
each finds its own state (plan, group, sharded layers) from its parameters, issues every
collective over its own group, and ends where its unsharded reference does."""

import torch
import torch.distributed as dist

import autoshard
from autoshard.core.parallel_state import state_of
from hf_models import build
from multirank import run_on_ranks

MAX_NORM = 0.5


def _batch(step: int):
    return torch.randint(0, 101, (4, 8), generator=torch.Generator().manual_seed(700 + step))


def _two_models_side_by_side(steps: int = 6):
    rank = dist.get_rank()
    # Every rank creates every group, in the same order: rows {0, 1}, {2, 3}; columns {0, 2}, {1, 3}.
    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    columns = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    runs = []
    for kind, group, optimizer in (("llama", rows[rank // 2], "adamw"), ("gemma", columns[rank % 2], "sgd")):
        model, reference = build(kind, seed=3), build(kind, seed=3)
        autoshard.parallelize(model, group=group)
        if optimizer == "adamw":
            opt = autoshard.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
            ref_opt = torch.optim.AdamW(reference.parameters(), lr=2e-3, weight_decay=0.1)
        else:
            opt = autoshard.optim.SGD(model.parameters(), lr=5e-2, momentum=0.9)
            ref_opt = torch.optim.SGD(reference.parameters(), lr=5e-2, momentum=0.9)
        runs.append(dict(model=model, reference=reference, opt=opt, ref_opt=ref_opt, group=group, norms=[],
                         groups_seen=set()))
    for step in range(steps):
        ids = _batch(step)
        for run in runs:  # one step of each model in turn
            model, reference = run["model"], run["reference"]
            with autoshard.CommCounter() as counter:
                run["opt"].zero_grad()
                model(input_ids=ids, labels=ids).loss.backward()
                norm = autoshard.clip_grad_norm_(model.parameters(), MAX_NORM)
                run["opt"].step()
            run["groups_seen"].update(counter.groups)
            run["ref_opt"].zero_grad()
            reference(input_ids=ids, labels=ids).loss.backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
            run["ref_opt"].step()
            run["norms"].append((float(norm), float(ref_norm)))
    results = []
    for run in runs:
        model = run["model"]
        got, want = autoshard.full_state_dict(model), run["reference"].state_dict()
        worst = max(float((got[k] - want[k]).abs().max()) for k in want)
        state = state_of(model)
        results.append(dict(worst=worst, norms=run["norms"], own_group_only=run["groups_seen"] == {run["group"].group_name},
                            state_group=state.group is run["group"], plan=state.plan is not None))
    distinct = state_of(runs[0]["model"]) is not state_of(runs[1]["model"])
    for group in (rows[rank // 2], columns[rank % 2]):  # the others are placeholders on this rank
        dist.destroy_process_group(group)
    return distinct, results


def test_two_models_over_different_groups_train_side_by_side():
    for distinct, results in run_on_ranks(_two_models_side_by_side, 4, timeout=600):
        assert distinct
        for r in results:
            assert r["own_group_only"] and r["state_group"] and r["plan"], r
            assert r["worst"] < 1e-4, r["worst"]
            assert any(ref > MAX_NORM for _, ref in r["norms"]), "clipping never acted"
            for got, ref in r["norms"]:
                assert abs(got - ref) <= 1e-5 * ref, (got, ref)
