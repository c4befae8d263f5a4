"""benchmarks/bench_init.py's code path at a tiny GPT on 2 ranks: the file it writes, the
zeroshard recipes (meta and normal builds) loading it, and the JSON it reports.

Held to: both recipes load exactly the file's values (compared on rank 0 in the file's dtype);
they hold the same model-state bytes, equal to the stage-3 formula; at stage 3 every rank reads
only its shards, so the trained-parameter bytes read sum over the ranks to the file's tensor
bytes, and the read syscalls counted by /proc/self/io cover them. FSDP2's recipe is not run here
(it is the benchmark's reference, not zeroshard's code).
"""

import json

from safetensors import safe_open

import bench_init
from model_state import model_state_bytes, stage3_unit_numels

SHAPE = ["--dim", "32", "--layers", "2", "--heads", "2", "--vocab", "96", "--max-seq", "16"]
ROW_FIELDS = {"peak_rss", "over_baseline", "rss_baseline", "bound", "model_state_bytes", "formula_bytes",
              "init_seconds", "load_seconds", "bytes_read_max", "bytes_read_total", "file_bytes", "ranks"}
RANK_FIELDS = {"rss_baseline", "peak_rss_baseline", "peak_rss_after_init", "peak_rss", "init_seconds",
               "load_seconds", "model_state_bytes", "bytes_read", "param_bytes_read", "rchar", "read_bytes",
               "mismatched"}


def _tensor_bytes(path):
    with safe_open(path, framework="pt") as f:
        return sum(f.get_tensor(k).nbytes for k in f.keys())


def test_zeroshard_recipes_load_their_shards_of_the_file(tmp_path):
    path, out = str(tmp_path / "gpt.safetensors"), tmp_path / "out.json"
    bench_init.main(SHAPE + ["--world-size", "2", "--precision", "bf16", "--recipes", "zeroshard-meta,zeroshard-normal",
                             "--file", path, "--verify", "--json", str(out), "--timeout", "120"])
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert list(rows) == ["zeroshard-meta", "zeroshard-normal"]
    sizes = bench_init.gpt_sizes(32, 2, 2, 96, 16)
    units = stage3_unit_numels(bench_init.meta_gpt(sizes), 2)
    formula = sum(model_state_bytes(3, 2, sum(units), "bf16").values())
    file_tensor_bytes = _tensor_bytes(path)
    for name, row in rows.items():
        assert ROW_FIELDS <= set(row), name
        assert [set(r) for r in row["ranks"]] == [RANK_FIELDS] * 2, name
        assert row["ranks"][0]["mismatched"] == [], name  # rank 0 compares the whole model
        assert [r["model_state_bytes"] for r in row["ranks"]] == [formula] * 2, name
        assert sum(r["param_bytes_read"] for r in row["ranks"]) == file_tensor_bytes, name
        assert all(r["rchar"] >= r["bytes_read"] >= r["param_bytes_read"] > 0 for r in row["ranks"]), name
        assert row["file_bytes"] == report["file_bytes"]
