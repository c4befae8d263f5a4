"""benchmarks/bench_offload.py's code path with --tiny (DeepSpeed left out: it is the benchmark's
peer, not zeroshard's code), and the JSON it reports.

Held to: every implementation of the host AdamW reports a positive throughput; zeroshard's host
step and torch.optim.AdamW(fused=True) end with the values of the ATen kernel they both call,
exactly; the world-size-1 engine holds its state where offloaded_state_bytes says. In the
step-time rows every rank's memory_stats() by place is offloaded_state_bytes' exactly, and the
offloaded runs' losses are bitwise those of the same stage without offload.
"""

import json
import math

import bench_offload
from gpt import make_model
from model_state import model_state_bytes, offloaded_state_bytes, stage3_unit_numels

PLACES = ("host_params", "host_grads", "host_optimizer", "device_params", "device_grads", "device_optimizer")


def _expected(name, model, stage2_elements):
    """memory_stats()'s places for a step-time config, from the formulas alone."""
    stage = int(name[len("zeroshard-stage")])
    elements = sum(stage3_unit_numels(model, 2)) if stage == 3 else stage2_elements
    if "offload" not in name:
        state = model_state_bytes(stage, 2, elements, "bf16")
        expected = {**{f"host_{k}": 0 for k in state}, **{f"device_{k}": v for k, v in state.items()}}
    else:
        expected = offloaded_state_bytes(stage, 2, elements, "bf16", optimizer=True, params="+param" in name)
    expected["host_total"] = sum(v for k, v in expected.items() if k.startswith("host_"))
    expected["device_total"] = sum(v for k, v in expected.items() if k.startswith("device_"))
    return expected


def test_offload_benchmark_measures_the_offloaded_paths(tmp_path):
    out = tmp_path / "out.json"
    bench_offload.main(["--tiny", "--no-deepspeed", "--json", str(out), "--timeout", "120"])
    report = json.loads(out.read_text())
    s = report["settings"]

    rows = {(r["peer"], r["numel"]): r for r in report["throughput"]}
    assert set(rows) == {(p, n) for p in bench_offload.PEERS for n in s["sizes"]}
    for (peer, numel), r in rows.items():
        if peer == bench_offload.DEEPSPEED:
            assert r["error"] == "left out (--no-deepspeed)"
            continue
        assert "error" not in r, r
        assert len(r["seconds"]) == s["reps"] and min(r["seconds"]) > 0, peer
        assert r["elements_per_second"] == numel / r["median_seconds"] > 0, peer
        assert r["threads"] == report["threads"] >= 1
        if peer in ("zeroshard engine.step()", "zeroshard engine.step(), no offload", "AdamW(fused=True)"):
            assert r["max_abs_diff_vs_kernel"] == 0.0, peer  # at::_fused_adamw_, the same arithmetic
    for numel in s["sizes"]:
        memory = rows[("zeroshard engine.step()", numel)]["memory"]
        assert {k: memory[k] for k in PLACES} == offloaded_state_bytes(1, 1, numel, "fp32")

    steps = report["steps"]
    assert list(steps) == list(bench_offload.CONFIGS)
    model = make_model(s["seed"], **s["model"], max_seq=s["seq"])
    stage2_elements = steps["zeroshard-stage2-bf16"]["memory"][0]["params"] // 2
    for name, row in steps.items():
        expected = _expected(name, model, stage2_elements)
        assert [{k: m[k] for k in expected} for m in row["memory"]] == [expected] * 2, name
        assert row["formula"] == expected and row["matches_formula"], name
        assert row["median_ms"] > 0 and row["cpu_median_ms"] > 0, name
        assert all(math.isfinite(x) for rank in row["losses"] for run in rank for x in run), name
        base = bench_offload.CONFIGS[name]
        if base is not None:
            assert row["losses"] == steps[base]["losses"], f"{name}: losses differ from {base}'s"
            assert row["losses_equal_base"] and row["ratio"] > 0
            assert row["memory"][0]["host_total"] > 0
