"""benchmarks/bench_stages.py's DeepSpeed rows on a tiny GPT, 2 Gloo ranks.

Held to: DeepSpeed's ZeRO-1 through the real `deepspeed` package (skipped where it is not
installed) trains the same fp32 steps as DDP and zeroshard stage 1 (held-out losses within the
benchmark's tolerance, so a misconfigured peer shows), and gets its stage-by-stage row against
zeroshard; where deepspeed does not import, its rows are left out with the reason printed and
in the JSON, and the run still succeeds.
"""

import importlib.util
import json
import sys

import pytest

import bench_stages

TINY = ["--steps", "2", "--warmup", "1", "--rounds", "1", "--layers", "1", "--batch", "2", "--seq", "16",
        "--timeout", "240"]


def _main(monkeypatch, tmp_path, configs):
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", ["bench_stages.py", *TINY, "--configs", configs, "--json", str(out)])
    code = bench_stages.main()
    return code, json.loads(out.read_text())


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_deepspeed_stage1_trains_ddps_steps_and_is_compared_with_zeroshard(monkeypatch, tmp_path, capsys):
    code, report = _main(monkeypatch, tmp_path, "ddp,zeroshard-stage1,deepspeed-stage1")
    printed = capsys.readouterr().out
    assert code == 0, report["problems"]
    assert report["problems"] == [] and report["left_out"] == {}
    assert report["deepspeed_version"]
    results = report["results"]
    assert list(results) == ["ddp", "zeroshard-stage1", "deepspeed-stage1"]
    ds = results["deepspeed-stage1"]
    assert ds["optimizer"].startswith(f"DeepSpeed {report['deepspeed_version']} ZeRO-1")
    assert ds["extras"][0]["deepspeed_optimizer"] == "DeepSpeedZeroOptimizer"
    # torch's AdamW on DeepSpeed's partitions, fused where the torch rows are.
    assert ds["extras"][0]["torch_optimizer"] == "AdamW"
    assert ds["extras"][0]["torch_fused"] == (report["settings"]["fused"] or None)
    ref = results["ddp"]["eval_loss"]
    assert abs(ds["eval_loss"] - ref) <= bench_stages.LOSS_TOLERANCE * abs(ref)
    assert "| zeroshard-stage1 | deepspeed-stage1 |" in printed
    assert "zeroshard stage 1 CPU ms <= DeepSpeed stage 1's" in printed


def test_deepspeed_rows_are_left_out_with_the_reason_when_it_does_not_import(monkeypatch, tmp_path, capsys):
    why = "import deepspeed on CPU failed: ImportError: made up by the test"
    monkeypatch.setattr(bench_stages, "deepspeed_unavailable", lambda: (None, why))
    code, report = _main(monkeypatch, tmp_path, "ddp,deepspeed-stage1,deepspeed-stage2")
    printed = capsys.readouterr().out
    assert code == 0, report["problems"]
    assert list(report["results"]) == ["ddp"]
    assert report["left_out"] == {"deepspeed-stage1": why, "deepspeed-stage2": why}
    assert f"DeepSpeed configs left out: {why}" in printed
    assert f"deepspeed-stage2: {why}" in printed
