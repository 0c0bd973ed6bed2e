"""The training example, run the way a user runs it: torchrun with 2 gloo ranks, briefly."""

import os
import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"


def test_train_gpt_learns_and_equals_the_unsharded_model(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(EXAMPLE), "--steps", "20", "--seq-len", "32", "--batch-size", "4", "--save-every", "10",
               "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output

    assert "ShardingPlan for 2 ranks" in result.stdout
    # GPT-2's 5 heads over 2 ranks: 3 and 2 heads of 48 in each of q, k and v.
    assert re.search(r"transformer\.h\.0\.attn\.c_attn\s+column\s+5\s+432/288 of 720", result.stdout), result.stdout

    memory = re.search(r"parameters: ([\d.]+) MiB unsharded; rank 0 holds ([\d.]+) MiB .*rank 1 holds ([\d.]+) MiB",
                       result.stdout)
    assert memory, result.stdout
    full, rank0, rank1 = map(float, memory.groups())
    assert rank0 < full and rank1 < full and rank0 + rank1 > full  # small layers stay replicated

    loss = re.search(r"loss: ([\d.]+) -> ([\d.]+)", result.stdout)
    assert loss, result.stdout
    first, last = map(float, loss.groups())
    assert 5.0 < first < 6.0  # about ln 256: random weights guess bytes uniformly
    assert last < first - 0.5

    line = re.search(r"collectives per step: (.*)", result.stdout)
    assert line, result.stdout
    counts = {kind: int(n) for kind, n in re.findall(r"'(\w+)': (\d+)", line.group(1).split("(planned")[0])}
    # Megatron's minimum: one all-reduce per attention and per MLP in forward and in backward over 4
    # blocks, plus the vocab-parallel lookup's and the head's input gradient. Loss parallelism keeps
    # the logits sharded: no gather, three all-reduces of one value per token in the loss. Clipping
    # adds one all-reduce of the shards' squared norms.
    assert "all_gather" not in counts, line.group(0)
    assert counts.get("all_reduce") == 18 + 3 + 1, line.group(0)

    # Saved asynchronously at steps 10 and 20, both kept; the last one consolidated for transformers.
    assert re.search(r"checkpoints: step-10, step-20 kept in ", result.stdout), result.stdout
    assert (tmp_path / "checkpoints" / "step-20" / "COMMITTED").exists()
    assert "consolidated step-20 into" in result.stdout and (tmp_path / "hf" / "model.safetensors").exists()

    difference = re.search(r"max abs difference ([\d.e+-]+)", result.stdout)
    assert difference, result.stdout
    assert float(difference.group(1)) < 1e-4

    curve = re.search(r"loss curve: (\S+)", result.stdout)
    assert curve, result.stdout
    png = Path(curve.group(1))
    assert png.parent == tmp_path
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
