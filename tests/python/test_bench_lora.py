"""benchmarks/bench_lora.py's code path at a tiny peft LoRA Llama on 2 ranks, and the JSON it
reports. zeroshard stage 3 only: FSDP2 and DDP are the benchmark's peers, not zeroshard's code
(and each setup costs a fresh pair of processes importing transformers and peft).

Held to: the units the engine found are the decoder layers, then the root; each rank's frozen
bytes are every unit's frozen (bf16) elements padded and split over the ranks, exactly, and add up
over the ranks to no less than the whole base; the trained bytes are 16 per padded trained
element over the ranks (fp32 parameter and gradient shards, AdamW's two moments); the table's
columns are the worst rank's numbers; the losses are finite.
"""

import json
import math

import pytest

import bench_lora
from model_state import padded_numel

WORLD = 2
SHAPE = ["--hidden", "64", "--intermediate", "128", "--layers", "2", "--heads", "2", "--vocab", "256",
         "--seq", "16", "--batch", "2"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_lora") / "out.json"
    status = bench_lora.main([*SHAPE, "--ranks", str(WORLD), "--setups", "zeroshard-stage3", "--steps", "1",
                              "--warmup", "1", "--timeout", "120", "--json", str(out)])
    assert status == 0
    return json.loads(out.read_text())


def _expected_units(settings):
    """(name, frozen names, frozen elements, trained elements) of each stage-3 unit: the decoder
    layers, then the root (every other parameter)."""
    model = bench_lora.build_model(settings)
    layer_names = {id(layer): name for name, layer in model.named_modules()
                   if any(layer is child for child in bench_lora.decoder_layers(model))}
    units = {name: ([], 0, 0) for name in layer_names.values()}
    units["<root>"] = ([], 0, 0)
    for name, p in model.named_parameters():
        unit = next((u for u in layer_names.values() if name.startswith(u + ".")), "<root>")
        frozen, frozen_numel, trained_numel = units[unit]
        if p.requires_grad:
            units[unit] = (frozen, frozen_numel, trained_numel + p.numel())
        else:
            assert p.dtype == bench_lora.DTYPES[settings["base_dtype"]], name
            units[unit] = (frozen + [name], frozen_numel + p.numel(), trained_numel)
    return [(name, *value) for name, value in units.items()]


def test_units_are_the_decoder_layers_then_the_root(report):
    row = report["rows"][str(WORLD)]["zeroshard-stage3"]
    expected = _expected_units(report["settings"])
    for rank in row["ranks"]:
        units = rank["info"]["units"]
        assert [u["name"] for u in units] == [name for name, *_ in expected]
        assert [u["root"] for u in units] == [False] * (len(units) - 1) + [True]
        assert [sorted(u["frozen"]) for u in units] == [sorted(frozen) for _, frozen, *_ in expected]


def test_frozen_and_trained_bytes_are_the_sharded_formula(report):
    """Persistence threshold 0: every parameter sharded, as FSDP2 shards them."""
    s = report["settings"]
    assert s["persistence_threshold"] == 0 and s["base_dtype"] == "bf16"
    expected = _expected_units(s)
    frozen = sum(padded_numel(n, WORLD) // WORLD * 2 for _, _, n, _ in expected if n)
    trained = sum(padded_numel(n, WORLD) // WORLD for _, _, _, n in expected if n)
    row = report["rows"][str(WORLD)]["zeroshard-stage3"]
    for rank in row["ranks"]:
        m = rank["memory"]
        assert m["frozen"] == frozen
        assert (m["params"], m["grads"], m["optimizer"], m["buckets"]) == (4 * trained, 4 * trained, 8 * trained, 0)
        assert m["gathered_peak"] > 0
    assert report["frozen_bytes_whole"] == 2 * sum(n for _, _, n, _ in expected)
    assert WORLD * frozen >= report["frozen_bytes_whole"] > (WORLD - 1) * frozen
    assert report["trained_numel"] == sum(n for _, _, _, n in expected)
    assert row["frozen"] == frozen and row["trained"] == 16 * trained


def test_table_columns_are_the_worst_ranks(report):
    row = report["rows"][str(WORLD)]["zeroshard-stage3"]
    ranks = row["ranks"]
    assert len(ranks) == WORLD and [r["rank"] for r in ranks] == list(range(WORLD))
    assert row["peak_rss"] == max(r["peak_rss"] for r in ranks)
    assert row["over_baseline"] == max(r["peak_rss"] - r["rss_before"] for r in ranks)
    for r in ranks:
        assert r["peak_rss"] >= r["rss_before"] > 0
        assert r["peak_since_start_of_training"] and r["build_peak_rss"] >= r["rss_wrapped"] > 0
        assert len(r["step_seconds"]) == len(r["step_cpu_seconds"]) == report["settings"]["steps"]
        assert len(r["losses"]) == report["settings"]["steps"] + report["settings"]["warmup"]
        assert all(math.isfinite(x) for x in r["losses"])
    assert row["first_loss"] == pytest.approx(sum(r["losses"][0] for r in ranks) / WORLD)
    assert report["problems"] == []


def test_an_unknown_setup_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        bench_lora.main(["--setups", "zeroshard-stage2"])
    assert "zeroshard-stage2" in capsys.readouterr().err
