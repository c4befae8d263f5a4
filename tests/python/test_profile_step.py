"""benchmarks/profile_step.py: one torch.profiler Chrome trace per rank with the engine's phases
named (Note [profiler names] in csrc/zeroshard/engine/engine.cpp), run as a user runs it (2
spawned Gloo ranks, the tiny GPT)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2


def _run(tmp_path, stage):
    out = tmp_path / f"stage{stage}"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "profile_step.py"), "--tiny", "--stage", str(stage),
                           "--steps", str(STEPS), "--warmup", "1", "--out", str(out), "--timeout", "240"],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done.stdout


def _spans(path):
    events = json.loads(Path(path).read_text())["traceEvents"]
    counts = {}
    for e in events:
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("zeroshard::"):
            counts[e["name"]] = counts.get(e["name"], 0) + 1
    return counts


@pytest.mark.parametrize("stage", (1, 3))
def test_each_rank_writes_a_trace_with_the_engine_phases_named(tmp_path, stage):
    out, stdout = _run(tmp_path, stage)
    for rank in (0, 1):
        spans = _spans(out / f"rank{rank}.json")
        # One forward, backward, boundary step and optimizer update per profiled step.
        for phase in ("forward", "backward", "step", "optimizer_step"):
            assert spans.get(f"zeroshard::{phase}") == STEPS, (rank, phase, spans)
        assert spans.get("zeroshard::reduce_bucket", 0) >= STEPS, spans
        if stage == 1:
            assert spans.get("zeroshard::gather_params") == STEPS, spans  # the all-gather after each update
            assert "zeroshard::gather_unit" not in spans
        else:
            # Every block is gathered (forward, and again for backward) and released.
            for phase in ("gather_unit", "wait_unit", "release_unit"):
                assert spans.get(f"zeroshard::{phase}", 0) >= 2 * STEPS, (phase, spans)
            assert "zeroshard::gather_params" not in spans


def test_the_trace_and_wall_clock_breakdown_time_the_same_calls(tmp_path):
    _, stdout = _run(tmp_path, 3)
    rows = {m.group(1): (float(m.group(2)), float(m.group(3)))
            for m in re.finditer(r"^zeroshard::(\w+)\s+\d+\s+([\d.]+)\s+([\d.]+)\s*$", stdout, re.M)}
    assert set(rows) == {"forward", "backward", "step"}, stdout
    for phase, (trace_ms, breakdown_ms) in rows.items():
        # Two clocks around the same calls: they differ by the profiler's and timers' own cost.
        assert abs(trace_ms - breakdown_ms) <= 0.2 * breakdown_ms + 0.5, (phase, trace_ms, breakdown_ms, stdout)
