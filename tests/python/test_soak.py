"""benchmarks/soak.py's verdict (the soak itself is not part of CI: `python benchmarks/soak.py`,
tens of minutes): a rank is flat when its RSS grew at most the tolerance after warm-up and its
memory_stats() total never changed; growth past it, or a changed total, fails."""

import pytest

import soak

S = dict(steps=10, save_every=4, warmup=3)


def _rank(rss_mb, state=100):
    return {"rss": [int(x * 1e6) for x in rss_mb], "state": [state] * len(rss_mb), "saves": 2}


def test_flat_ranks_pass_and_growth_after_warm_up_fails():
    # Settled after the first save (step 4, index 3): what came before is warm-up.
    flat = _rank([10, 50, 90, 100, 100.5, 101, 100, 100, 100.2, 100.9])
    growing = _rank([10, 50, 90, 100, 102, 104, 106, 108, 110, 112])
    rows = soak.verdict([flat, growing], S, tolerance_mb=2.0)
    assert [r["ok"] for r in rows] == [True, False]
    assert rows[0]["growth_mb"] == pytest.approx(0.9) and rows[1]["growth_mb"] == pytest.approx(12.0)
    assert rows[0]["rss_settled_mb"] == pytest.approx(100.0) and rows[1]["rss_peak_mb"] == pytest.approx(112.0)


def test_a_changed_model_state_fails_even_without_rss_growth():
    changed = _rank([100] * 10)
    changed["state"][-1] += 8
    (row,) = soak.verdict([changed], S, tolerance_mb=2.0)
    assert not row["state_constant"] and not row["ok"]


def test_too_few_steps_are_refused():
    with pytest.raises(SystemExit):
        soak.main(["--tiny", "--steps", "3"])
