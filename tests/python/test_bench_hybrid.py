"""benchmarks/bench_hybrid.py's code path with --tiny, and the JSON it reports.

Held to: every config's row is there and counted the same on every rank and step; with hybrid
sharding or hpZ the intra and inter levels add up to the step's traffic, and a flat row counts
all of it inter-node (the benchmark's model); the inter bytes of the 2x2 rows are the all-reduce
of each rank's shard (4 bytes x padded elements / group size, counted twice as traffic), as in
test_hybrid.py; the hpZ row gathers the blocks inside the node in the backward and everything
else as flat stage 3 does, holds half of every block as secondary shards, and trains bitwise as
flat stage 3, as in test_hpz.py; every projected time is intra / intra bandwidth + inter / inter
bandwidth, the user's --link among them; the 2x2 runs train the flat runs' model; the printed
text carries the measured flat / hpZ ratio beside DeepSpeed's claim.
"""

import json

import pytest

import bench_hybrid
from gpt import make_model
from model_state import stage3_unit_numels

LINK = (50.0, 200.0)  # GB/s inside a node, Gb/s across


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench_hybrid")
    out, markdown = tmp / "out.json", tmp / "out.md"
    bench_hybrid.main(["--tiny", "--link", "50,200", "--json", str(out), "--markdown", str(markdown),
                       "--timeout", "120"])
    return {**json.loads(out.read_text()), "markdown": markdown.read_text()}


def _two_levels(name):
    """Whether comm_stats() splits the row's traffic by level: hybrid sharding or hpZ."""
    _, group, hpz = bench_hybrid.CONFIGS[name]
    return group is not None or hpz is not None


def _units(report):
    """Padded elements of the GPT's stage-3 units over the world of 4: the blocks, then the root."""
    s = report["settings"]
    model = make_model(s["seed"], **s["model"], max_seq=s["seq"])
    assert len(model.blocks) == s["model"]["layers"]  # stage3_unit_numels reads model.blocks: the Block units
    return stage3_unit_numels(model, bench_hybrid.WORLD)


def test_every_config_has_a_row_counted_alike_on_every_rank_and_step(report):
    rows = report["rows"]
    assert list(rows) == list(bench_hybrid.CONFIGS)
    for name, row in rows.items():
        assert row["steady"], name
        assert len(row["memory"]) == len(row["losses"]) == bench_hybrid.WORLD, name
        _, group, hpz = bench_hybrid.CONFIGS[name]
        levels = {"intra", "inter"} if _two_levels(name) else set()
        assert set(row["comm"]) == {"all_gather", "reduce_scatter", "all_reduce", "broadcast", "traffic_bytes"} | levels
        assert row["shard_group_size"] == (group or bench_hybrid.WORLD)
        assert row["hpz_partition_size"] == hpz


def test_levels_add_up_to_the_step_and_flat_counts_all_of_it_inter_node(report):
    for name, row in report["rows"].items():
        comm = row["comm"]
        assert row["total_traffic_bytes"] == comm["traffic_bytes"] > 0, name
        if _two_levels(name):
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


def test_hpz_gathers_the_blocks_inside_the_node_in_the_backward(report):
    """Forward gathers every unit over both nodes (4 bytes x Σ units); the backward gathers the
    blocks inside the node (4 x Σ blocks; the root unit stays gathered to its backward); the
    step's traffic is flat stage 3's, less the blocks' backward gathers across nodes."""
    units = _units(report)
    row, flat = report["rows"][f"stage3-hpz{bench_hybrid.HPZ}"], report["rows"]["stage3-flat"]
    intra, inter = row["comm"]["intra"], row["comm"]["inter"]
    assert row["shard_group_size"] == bench_hybrid.WORLD and row["hpz_partition_size"] == 2
    assert intra["traffic_bytes"] + inter["traffic_bytes"] == row["total_traffic_bytes"] == flat["total_traffic_bytes"]
    assert intra["all_gather"]["bytes"] == 4 * sum(units[:-1])
    assert intra["reduce_scatter"]["bytes"] == intra["all_reduce"]["bytes"] == 0
    assert inter["all_gather"]["bytes"] == 4 * sum(units)
    assert flat["inter"] - row["inter"] == row["intra"] == 4 * sum(units[:-1])
    assert row["flat_inter_ratio"] == flat["inter"] / row["inter"]
    assert 1 < row["flat_inter_ratio"] < 1.5  # 3M to 2M, less the root unit's backward gather


def test_hpz_holds_half_of_every_block_and_trains_bitwise_as_flat(report):
    units = _units(report)
    rows = report["rows"]
    row, flat = rows[f"stage3-hpz{bench_hybrid.HPZ}"], rows["stage3-flat"]
    assert row["losses"] == flat["losses"]  # hpZ changes where a gather reads from, not a value
    for memory, flat_memory in zip(row["memory"], flat["memory"]):
        assert memory["secondary_peak"] == 4 * sum(units[:-1]) // bench_hybrid.HPZ
        assert {k: v for k, v in memory.items() if k != "secondary_peak"} == \
            {k: v for k, v in flat_memory.items() if k != "secondary_peak"}
    assert row["secondary_peak"] == 4 * sum(units[:-1]) // bench_hybrid.HPZ
    for name, other in rows.items():
        if other["hpz_partition_size"] is None:
            assert other["secondary_peak"] == 0 and all(m["secondary_peak"] == 0 for m in other["memory"]), name


def test_the_measured_hpz_ratio_stands_beside_deepspeeds_claim(report):
    ratio = report["rows"][f"stage3-hpz{bench_hybrid.HPZ}"]["flat_inter_ratio"]
    text = report["markdown"]
    assert f"Measured flat / hpZ inter-node bytes at stage 3, zero_hpz_partition_size 2: {ratio:.2f}x." in text
    assert "4x" in report["zero_pp_claim"] and report["zero_pp_claim"] in text
    assert "3M to 2M" in report["hpz_alone"] and report["hpz_alone"] in text
    assert "zero_quantized_weights" in report["hpz_alone"] and "not implemented" in report["hpz_alone"]
    secondary = report["rows"]["stage3-hpz2"]["secondary_peak"] / bench_hybrid.MB
    assert any(line.startswith("| stage3-hpz2 | 4 |") and f"| {secondary:.2f} |" in line for line in text.splitlines())


@pytest.mark.parametrize("link", ["50", "a,b", "0,100"])
def test_a_bad_link_is_refused_by_name(link, capsys):
    with pytest.raises(SystemExit):
        bench_hybrid.main(["--link", link])
    assert f"--link {link!r}" in capsys.readouterr().err
