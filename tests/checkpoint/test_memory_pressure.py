"""An asynchronous save that fails for lack of memory under a real address-space limit
(RLIMIT_AS, set by each rank of a 2-rank torchrun job) raises its error on every rank,
releases its snapshot buffers, and leaves training and a later, smaller save working under the
same limit (see memory_pressure_worker.py)."""

import json
import os

from autoshard import checkpoint
from local_ranks import run_under_torchrun

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support",
                      "memory_pressure_worker.py")


def test_a_save_that_does_not_fit_under_rlimit_as_fails_frees_and_training_goes_on(tmp_path):
    run_under_torchrun(SCRIPT, tmp_path)
    results = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    for result in results:
        # The failed save raised on every rank, naming the rank whose copy ran out of memory.
        assert result["error"] is not None and "could not copy its tensors" in result["error"], result
        assert "alloc" in result["error"].lower() or "memory" in result["error"].lower(), result
        assert result["kept_bytes"] == 0, result
        assert len(result["after"]) == 5 and all(loss == loss for loss in result["after"]), result
        assert result["model_only"] == "committed", result
        assert result["full_after"] == "committed", result
    assert not os.path.exists(tmp_path / "full") and not os.path.exists(tmp_path / "full.partial")
    for name in ("model-only", "full-after"):
        checkpoint.read_manifest(tmp_path / name)
