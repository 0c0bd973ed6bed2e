"""The README's "Using it" example, run as written under torchrun on 2 gloo ranks, against the
same training done on the unsharded model in one process."""

import re
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from local_ranks import run_under_torchrun


README = Path(__file__).resolve().parents[2] / "README.md"


def _example() -> str:
    text = README.read_text()
    section = text.split("\n## Using it", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block, "the README's Using it section has no python block"
    return block.group(1)


def _unsharded_run(directory: Path) -> dict:
    """The example's training loop, with the plain model and torch's AdamW and clipping."""
    config = AutoConfig.from_pretrained(str(directory / "pretrained"))
    model = AutoModelForCausalLM.from_pretrained(str(directory / "pretrained")).float()
    steps = int(re.search(r"for step in range\((\d+)\)", _example()).group(1))
    shape = tuple(int(n) for n in re.search(r"config\.vocab_size, \((\d+), (\d+)\)", _example()).groups())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    batches = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, config.vocab_size, shape, generator=batches)
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def test_readme_example_runs_as_written_and_trains_as_the_unsharded_model(tmp_path):
    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path / "pretrained"))
    script = tmp_path / "train.py"
    script.write_text(_example())
    stdout = run_under_torchrun(script, cwd=tmp_path)
    assert stdout.count("ShardingPlan for 2 ranks") == 1  # printed by rank 0 only

    finetuned = AutoModelForCausalLM.from_pretrained(str(tmp_path / "finetuned")).float().state_dict()
    want = _unsharded_run(tmp_path)
    pretrained = AutoModelForCausalLM.from_pretrained(str(tmp_path / "pretrained")).state_dict()
    assert finetuned.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(finetuned[name], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert not torch.equal(finetuned["model.layers.0.self_attn.q_proj.weight"],
                           pretrained["model.layers.0.self_attn.q_proj.weight"])  # it trained
