"""benchmarks/bench_hybrid.py's code path with --tiny, and the JSON it reports.

Held to: every config's row is there and counted the same on every rank and step; with hybrid
sharding the intra and inter levels add up to the step's traffic, and a flat row counts all of
it inter-node (the benchmark's model); the inter bytes of the 2x2 rows are the all-reduce of
each rank's shard (4 bytes x padded elements / group size, counted twice as traffic), as in
test_hybrid.py; every projected time is intra / intra bandwidth + inter / inter bandwidth,
the user's --link among them; the 2x2 runs train the flat runs' model.
"""

import json

import pytest

import bench_hybrid
from gpt import make_model
from model_state import stage3_unit_numels

LINK = (50.0, 200.0)  # GB/s inside a node, Gb/s across


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_hybrid") / "out.json"
    bench_hybrid.main(["--tiny", "--link", "50,200", "--json", str(out), "--timeout", "120"])
    return json.loads(out.read_text())


def test_every_config_has_a_row_counted_alike_on_every_rank_and_step(report):
    rows = report["rows"]
    assert list(rows) == list(bench_hybrid.CONFIGS)
    for name, row in rows.items():
        assert row["steady"], name
        assert len(row["memory"]) == len(row["losses"]) == bench_hybrid.WORLD, name
        levels = {"intra", "inter"} if name.endswith("2x2") else set()
        assert set(row["comm"]) == {"all_gather", "reduce_scatter", "all_reduce", "broadcast", "traffic_bytes"} | levels
        assert row["shard_group_size"] == (bench_hybrid.GROUP if name.endswith("2x2") else bench_hybrid.WORLD)


def test_levels_add_up_to_the_step_and_flat_counts_all_of_it_inter_node(report):
    for name, row in report["rows"].items():
        comm = row["comm"]
        assert row["total_traffic_bytes"] == comm["traffic_bytes"] > 0, name
        if name.endswith("2x2"):
            assert comm["intra"]["traffic_bytes"] + comm["inter"]["traffic_bytes"] == comm["traffic_bytes"], name
            assert (row["intra"], row["inter"]) == (comm["intra"]["traffic_bytes"], comm["inter"]["traffic_bytes"])
            assert row["intra"] > 0 and row["inter"] > 0, name
        else:
            assert "intra" not in comm and "inter" not in comm, name
            assert (row["intra"], row["inter"]) == (0, comm["traffic_bytes"]), name
        flat = report["rows"][f"stage{row['stage']}-flat"]
        assert row["flat_inter_ratio"] == flat["inter"] / row["inter"], name


def test_inter_bytes_of_2x2_are_the_all_reduce_of_each_shard(report):
    group = bench_hybrid.GROUP
    s = report["settings"]
    stage3_padded = sum(stage3_unit_numels(make_model(s["seed"], **s["model"], max_seq=s["seq"]), group))
    for name, stage in (("stage2-2x2", 2), ("stage3-2x2", 3)):
        row = report["rows"][name]
        inter = row["comm"]["inter"]
        for memory in row["memory"]:
            # Stage 2 holds the fp32 buckets whole (padded for the group); stage 3 its shard of them.
            padded = memory["params"] // 4 if stage == 2 else stage3_padded
            if stage == 3:
                assert memory["params"] == 4 * padded // group
            assert inter["all_reduce"]["bytes"] == 4 * padded // group, name
            assert inter["all_gather"]["bytes"] == inter["reduce_scatter"]["bytes"] == 0, name
            assert row["inter"] == inter["traffic_bytes"] == 2 * 4 * padded // group, name


def test_projection_is_bytes_over_bandwidth(report):
    links = {**bench_hybrid.LINKS, "--link 50 GB/s / 200 Gb/s": LINK}
    assert {k: tuple(v) for k, v in report["links"].items()} == links
    for name, row in report["rows"].items():
        assert set(row["projected_ms"]) == set(links), name
        for link, (intra_gbps, inter_gbitps) in links.items():
            expected = 1000 * (row["intra"] / (intra_gbps * 1e9) + row["inter"] * 8 / (inter_gbitps * 1e9))
            assert row["projected_ms"][link] == pytest.approx(expected, rel=1e-12), (name, link)


def test_2x2_trains_the_flat_runs_model(report):
    rows = report["rows"]
    for stage in (2, 3):
        flat, hybrid = rows[f"stage{stage}-flat"]["losses"], rows[f"stage{stage}-2x2"]["losses"]
        for flat_rank, hybrid_rank in zip(flat, hybrid):
            assert hybrid_rank[0] == flat_rank[0], stage  # the same weights before any step
            assert hybrid_rank == pytest.approx(flat_rank, rel=1e-4), stage


def test_hpz_is_said_to_be_missing_not_shown(report):
    assert "not implemented" in report["hpz"] and "4x" in report["zero_pp_claim"]
    assert not any("hpz" in name.lower() for name in report["rows"])


@pytest.mark.parametrize("link", ["50", "a,b", "0,100"])
def test_a_bad_link_is_refused_by_name(link, capsys):
    with pytest.raises(SystemExit):
        bench_hybrid.main(["--link", link])
    assert f"--link {link!r}" in capsys.readouterr().err
