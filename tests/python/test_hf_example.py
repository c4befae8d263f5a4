"""examples/finetune_trainer.py runs under a real torchrun at 2 ranks (TRL's SFTTrainer with LoRA
at stage 3, the model built on the meta device), and the README's "Hugging Face Trainer and TRL"
snippet is the example's code."""

import os
import re
import sys
import textwrap

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from launchers import ROOT, free_port, launcher_command, report, run_launchers  # noqa: E402

EXAMPLE = ROOT / "examples" / "finetune_trainer.py"


def _example_code():
    text = EXAMPLE.read_text()
    block = re.search(r"# --- the example's code .*?---\n(.*?)\n\s*# --- end ---", text, re.S).group(1)
    return textwrap.dedent(block).strip()


def test_readme_snippet_is_the_example_code():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Hugging Face Trainer and TRL", 1)[1].split("\n## ", 1)[0]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1).strip()
    assert snippet == _example_code()


def test_example_trains_lora_with_trl_under_torchrun(tmp_path):
    pytest.importorskip("trl")
    command = launcher_command(1, 2, free_port(), ["--work", str(tmp_path), "--max-steps", "4"], program=EXAMPLE)
    results, _ = run_launchers([command], [tmp_path / "launcher.log"], timeout=240)
    code, output = results[0]
    assert code == 0, report(results)
    line = next(line for line in output.splitlines() if line.startswith("finetune_trainer:"))
    assert "SFTTrainer + LoRA at stage 3 on 2 ranks, bf16" in line and "over 4 steps" in line, line
    first, last = (float(x) for x in re.search(r"loss (\S+) -> (\S+)", line).groups())
    assert last < first, line  # SFTConfig's defaults: bf16, activation checkpointing, on an fp32 base
    assert sorted(os.listdir(tmp_path / "final")) == ["adapter_config.json", "adapter_model.safetensors",
                                                      "tokenizer.json", "tokenizer_config.json", "training_args.bin"]
    checkpoints = [d for d in os.listdir(tmp_path / "run") if d.startswith("checkpoint-")]
    assert checkpoints == ["checkpoint-4"], checkpoints  # save_steps=4, save_total_limit=1
