"""benchmarks/bench_step.py on a small size: the engine's step is compared like with like.

Held to: at world size 1 the engine (with and without the nonfinite check) and plain torch
(backward, the fused kernel, .grad = None) end with bitwise the same weights after the same
steps, so the backward + step ratio compares the same work; every size has its rows at both
ranks' stages.
"""

import json


import bench_step


def test_the_step_benchmark_compares_the_engine_with_the_same_work(tmp_path):
    out = tmp_path / "out.json"
    bench_step.main(["--sizes", "4096,8192", "--reps", "2", "--warmup", "1", "--threads", "1", "--json", str(out),
                     "--timeout", "120"])
    report = json.loads(out.read_text())
    assert [r["numel"] for r in report["one_rank"]] == [4096, 8192]
    for r in report["one_rank"]:
        assert r["same_weights_as_torch"], r
        assert r["backward_step_ms"] > r["step_ms"] > 0
    assert [(r["numel"], r["stage"]) for r in report["two_ranks"]] == [(4096, 1), (4096, 2), (8192, 1), (8192, 2)]
