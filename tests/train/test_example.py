"""The training example, run the way a user runs it: torchrun with 2 gloo ranks, briefly."""

import re
from pathlib import Path

from local_ranks import run_under_torchrun

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_lm.py"


def _run(tmp_path, *options):
    stdout = run_under_torchrun(EXAMPLE, "--seq-len", "32", "--batch-size", "4", "--out", tmp_path, *options)
    assert "ShardingPlan for 2 ranks" in stdout
    return stdout


def _collectives(stdout):
    line = re.search(r"collectives per step: (.*)", stdout)
    assert line, stdout
    return {kind: int(n) for kind, n in re.findall(r"'(\w+)': (\d+)", line.group(1).split("(planned")[0])}


def test_train_llama_learns_and_equals_the_unsharded_model(tmp_path):
    stdout = _run(tmp_path, "--steps", "20", "--save-every", "10")
    # 5 heads over 2 ranks: 3 and 2 heads of 48.
    assert re.search(r"model\.layers\.0-3\.self_attn\.q_proj\s+column\s+5\s+144/96 of 240", stdout), stdout
    assert "sequence parallel (tokens split over the ranks)" in stdout
    assert "loss parallelism on: with labels, 'lm_head' keeps its vocabulary shard" in stdout

    memory = re.search(r"parameters: ([\d.]+) MiB unsharded; rank 0 holds ([\d.]+) MiB .*rank 1 holds ([\d.]+) MiB",
                       stdout)
    assert memory, stdout
    full, rank0, rank1 = map(float, memory.groups())
    assert rank0 < full and rank1 < full and rank0 + rank1 > full  # small layers stay replicated

    loss = re.search(r"loss: ([\d.]+) -> ([\d.]+)", stdout)
    assert loss, stdout
    first, last = map(float, loss.groups())
    assert 5.0 < first < 6.0  # about ln 256: random weights guess bytes uniformly
    assert last < first - 0.5

    # Megatron's minimum with sequence parallelism, over 4 blocks: each attention and each MLP
    # gathers its tokens and reduce-scatters its output in forward, and the reverse in backward;
    # the head gathers its tokens (and reduce-scatters their gradient). The vocab-parallel lookup
    # sums its shards once before the tokens are cut, the norms' partial gradients are summed in
    # one bucket, the loss over vocabulary shards takes three all-reduces of a few values per token
    # (no gather of the logits), and clipping one all-reduce of the shards' squared norms.
    assert _collectives(stdout) == {"all_gather": 2 * 4 * 2 + 1 + 1, "reduce_scatter": 2 * 4 * 2 + 1,
                                    "all_reduce": 1 + 1 + 3 + 1}, stdout

    saved = re.search(r"activations saved for backward per step: ([\d.]+) MiB unsharded \(largest tensor ([\d.]+) "
                      r"MiB\); rank 0 holds ([\d.]+) MiB \(\d+%; largest tensor ([\d.]+) MiB\), rank 1 holds ([\d.]+) "
                      r"MiB \(\d+%; largest tensor ([\d.]+) MiB\)", stdout)
    assert saved, stdout
    unsharded, unsharded_largest, rank0, largest0, rank1, largest1 = map(float, saved.groups())
    # Every sharded activation and half the tokens between the blocks: well under the whole.
    assert rank0 < 0.7 * unsharded and rank1 < 0.7 * unsharded, saved.group(0)
    assert largest0 < unsharded_largest and largest1 < unsharded_largest, saved.group(0)

    # Saved asynchronously at steps 10 and 20, both kept; the last one consolidated for transformers.
    assert re.search(r"checkpoints: step-10, step-20 kept in ", stdout), stdout
    assert (tmp_path / "checkpoints" / "step-20" / "COMMITTED").exists()
    assert "consolidated step-20 into" in stdout and (tmp_path / "hf" / "model.safetensors").exists()

    difference = re.search(r"max abs difference ([\d.e+-]+)", stdout)
    assert difference, stdout
    assert float(difference.group(1)) < 1e-4

    curve = re.search(r"loss curve: (\S+)", stdout)
    assert curve, stdout
    png = Path(curve.group(1))
    assert png.parent == tmp_path
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_gpt2_keeps_its_tokens_whole_and_says_why(tmp_path):
    stdout = _run(tmp_path, "--model", "gpt2", "--steps", "4", "--save-every", "4")
    # GPT-2's fused c_attn: 3 and 2 heads of 48 in each of q, k and v.
    assert re.search(r"transformer\.h\.0-3\.attn\.c_attn\s+column\s+5\s+432/288 of 720", stdout), stdout
    assert "sequence parallelism refused" in stdout
    # One all-reduce per attention and per MLP in forward and in backward over 4 blocks, the
    # lookup's and the head's input gradient, the loss's three and clipping's one.
    assert _collectives(stdout) == {"all_reduce": 18 + 3 + 1}, stdout
    difference = re.search(r"max abs difference ([\d.e+-]+)", stdout)
    assert difference and float(difference.group(1)) < 1e-4, stdout
