"""The planner (python -m zeroshard plan, zeroshard.planner): the standard table exactly, model
states equal to what the engine's memory_stats() reports for the same model (stages 0-3, fp32
and bf16, one bucket and several, kept parameters, accumulation, offload), traffic equal to its
comm_stats(), parameter counts of Hugging Face configs equal to transformers' models, and errors
that name the flag or key. The engine runs share one spawn per world size (spawn.SharedRuns).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from models import make_model
from spawn import SharedRuns
from training import engine_config, train_global_batches

from zeroshard.__main__ import main as zeroshard_main
from zeroshard.planner import ModelParams, model_state
from zeroshard.planner.hf_config import model_params, read_config
from zeroshard.planner.setups import STATES, ModelSource, Setup, card

ROOT = Path(__file__).resolve().parents[2]
GB = 10**9
# One bucket and the engine's defaults (stage 3 keeps every parameter of this small model
# gathered: all are under the 1e5-element persistence threshold); and several buckets, blocks
# released at stage 3 with their norms and biases kept, two micro-batches per step.
CASES = {
    "defaults": ({}, None, {}),
    "buckets": ({"reduce_bucket_size": 700, "stage3_param_persistence_threshold": 60}, 2, {"layers": 4}),
}
OFFLOAD = {"offload_optimizer": {"device": "cpu"}}
OFFLOAD_PARAMS = {"offload_param": {"device": "cpu"}}


def _config(case, stage, precision, offload=None):
    zero, gas, _ = CASES[case]
    return engine_config(stage, precision=precision, gas=gas, zero={**zero, **(offload or {})})


def _engine_numbers(rank, world_size, runs):
    import zeroshard

    out = {}
    for case, stage, precision, offload in runs:
        model = make_model(**CASES[case][2])
        engine = zeroshard.initialize(model, _config(case, stage, precision, offload))
        # The second step is the first that prefetches at stage 3 (the first records the order).
        train_global_batches(model, engine, rank, world_size, range(2))
        out[case, stage, precision, str(offload)] = (engine.memory_stats(), engine.comm_stats()["traffic_bytes"])
    return out


def _runs(world_size):
    runs = [(case, stage, precision, None) for case in CASES for precision in ("fp32", "bf16") for stage in range(4)]
    if world_size == 2:
        runs += [("buckets", 2, "bf16", OFFLOAD), ("buckets", 3, "bf16", {**OFFLOAD, **OFFLOAD_PARAMS})]
    return runs


@pytest.fixture(scope="module")
def engine_runs():
    # World size 4 is left out: four ranks on a 2-core machine take half a minute more.
    return SharedRuns({ws: {"numbers": (_engine_numbers, _runs(ws))} for ws in (1, 2)})


def _plan_card(case, stage, precision, world_size):
    model = ModelParams.of_module(make_model(**CASES[case][2]))
    return card(Setup(stage), ModelSource("test", model.numel, model), world_size, precision,
                _config(case, stage, precision))


@pytest.mark.parametrize("world_size", [1, 2])
def test_model_states_are_the_engines_memory_stats(engine_runs, world_size):
    """model_state() for the module and config zeroshard.initialize gets is memory_stats()'s
    params, grads and optimizer bytes exactly: the same buckets, units, kept unit and padding.
    (The frozen parameters' bytes and the totals with them: test_planner_frozen.py.)"""
    numbers = engine_runs.result(world_size, "numbers")
    for case, stage, precision, offload in _runs(world_size):
        flags = {"offload_optimizer": bool(offload), "offload_params": bool(offload and "offload_param" in offload)}
        expected = model_state(make_model(**CASES[case][2]), stage, world_size, precision,
                               _config(case, stage, precision, offload), **flags)
        trained = {k: v for k, v in expected.items() if not k.endswith(("frozen", "total"))}
        for rank, by_run in enumerate(numbers):
            mem, _ = by_run[case, stage, precision, str(offload)]
            assert {k: mem[k] for k in trained} == trained, (case, stage, precision, offload, rank)


@pytest.mark.parametrize("world_size", [1, 2])
def test_traffic_and_transients_are_the_engines(engine_runs, world_size):
    """Per-step traffic is comm_stats()' traffic_bytes; the fp32 gradient copy and stage 3's
    gathered units are the engine's peaks, and the staging estimate bounds its peak."""
    numbers = engine_runs.result(world_size, "numbers")
    for case, stage, precision, offload in _runs(world_size):
        if offload:
            continue
        planned = _plan_card(case, stage, precision, world_size)
        for by_run in numbers:
            mem, traffic = by_run[case, stage, precision, "None"]
            where = (case, stage, precision)
            assert planned.traffic["intra"] == traffic, where
            assert planned.transient["fp32_grads"] == mem["fp32_grads_peak"], where
            assert planned.transient["gathered"] == mem["gathered_peak"], where
            assert mem["staging_peak"] <= planned.transient["staging"], where
            assert (mem["staging_peak"] > 0) == (planned.transient["staging"] > 0), where


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "zeroshard", *args], capture_output=True, text=True, env=env,
                          timeout=120, cwd=ROOT)


def test_the_standard_table_8b_on_4_and_8_cards():
    """bf16 AdamW, 8e9 parameters: 128/56/44/32 GB per card on 4 cards, 128/44/30/16 on 8."""
    done = _cli("plan", "--params", "8e9", "--gpus", "4,8", "--gpu-memory", "80GB", "--json")
    assert done.returncode == 0, done.stderr
    plans = {p["gpus"]: {s["stage"]: s for s in p["setups"]} for p in json.loads(done.stdout)["plans"]}
    for gpus, states in ((4, [128, 56, 44, 32]), (8, [128, 44, 30, 16])):
        assert [plans[gpus][stage]["device"]["model_states"] for stage in range(4)] == [s * GB for s in states]
    assert plans[4][3]["traffic_bytes_per_step"]["intra"] == 3 * 2 * 8 * GB  # 3Ψ in bf16
    assert plans[4][2]["traffic_bytes_per_step"]["intra"] == 2 * 2 * 8 * GB



def test_the_text_table_shows_the_standard_numbers(capsys):
    assert zeroshard_main(["plan", "--params", "8e9", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in out.splitlines() if line.startswith("| ")}
    assert [rows[name][3] for name in ("DDP (stage 0)", "stage 1", "stage 2", "stage 3")] == \
        ["128.0", "44.0", "30.0", "16.0"]
    assert "Cheapest that fits: stage 1" in out


def _plan_json(capsys, *args):
    assert zeroshard_main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_setups_come_cheapest_first_with_offload_last(capsys):
    doc = _plan_json(capsys, "--params", "70B", "--gpus", "8", "--offload", "--shard-group", "4",
                     "--link", "pcie4", "--grad-accum", "4")
    names = [s["setup"] for s in doc["plans"][0]["setups"]]
    hybrid = ", shard 4 x 2 copies"
    assert names == ["DDP (stage 0)", "stage 1", "stage 1" + hybrid, "stage 2", "stage 2" + hybrid, "stage 3",
                     "stage 3" + hybrid] + [f"stage {s} + offload optimizer" for s in (1, 2, 3)] + \
        ["stage 3 + offload optimizer+params"], names
    traffic = [sum(s["traffic_bytes_per_step"][k] for k in ("intra", "inter")) for s in doc["plans"][0]["setups"]]
    assert traffic[:-4] == sorted(traffic[:-4])
    # With accumulation stage 2 reduce-scatters every micro-batch: (4 + 1)Ψ against stage 1's 2Ψ.
    by_name = {s["setup"]: s for s in doc["plans"][0]["setups"]}
    assert by_name["stage 2"]["traffic_bytes_per_step"]["intra"] == 5 * 2 * 70 * GB
    # Over 32 GB/s a ring of 8 sends 7/8 of each byte counted.
    stage1 = by_name["stage 1"]
    assert stage1["comm_seconds_per_step"] == pytest.approx(2 * 2 * 70 * GB * 7 / 8 / 32e9)


def test_activations_follow_korthikanti(capsys):
    """s·b·h·(34 + 5as/h) per layer, 4sbh(1 + V/h) once; with checkpointing 2sbh per layer
    plus one layer's full activations."""
    s, b, h, a, layers, vocab = 4096, 2, 4096, 32, 32, 128256
    shape = ["--hidden", str(h), "--layers", str(layers), "--heads", str(a), "--vocab", str(vocab),
             "--seq", str(s), "--micro-batch", str(b)]
    layer = s * b * h * 34 + 5 * a * s * s * b
    rest = 4 * s * b * h + 4 * s * b * vocab
    plain = _plan_json(capsys, "--params", "8e9", "--gpus", "4", *shape)["plans"][0]["setups"][0]
    ckpt = _plan_json(capsys, "--params", "8e9", "--gpus", "4", *shape,
                      "--activation-checkpointing")["plans"][0]["setups"][0]
    assert plain["activations"] == layers * layer + rest
    assert ckpt["activations"] == layers * 2 * s * b * h + layer + rest
    assert plain["total"] == plain["device"]["model_states"] + sum(plain["transient"].values()) + plain["activations"]


def test_layers_alone_estimate_stage3_units(capsys):
    """--params with --layers: L equal units, the one in use and the one prefetched gathered."""
    bare = {s["stage"]: s for s in _plan_json(capsys, "--params", "8e9", "--gpus", "8")["plans"][0]["setups"]}
    doc = _plan_json(capsys, "--params", "8e9", "--gpus", "8", "--layers", "32")
    stage3 = {s["stage"]: s for s in doc["plans"][0]["setups"]}[3]
    assert stage3["transient"]["gathered"] == 2 * 2 * 8 * GB // 32
    assert any("gathered units" in m for m in bare[3]["not_counted"])
    assert not any("gathered units" in m for m in stage3["not_counted"])


def test_a_module_factory_is_counted_on_the_meta_device(capsys):
    doc = _plan_json(capsys, "--module", "models:make_model", "--gpus", "2", "--dtype", "fp32")
    states = {s["stage"]: s["device"] for s in doc["plans"][0]["setups"]}
    for stage in range(4):
        expected = model_state(make_model(), stage, 2, "fp32")
        assert {k: states[stage][k] for k in STATES} == {k: expected[k] for k in STATES}


CONFIGS = {
    "llama_gqa": ("LlamaConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=100, intermediate_size=96)),
    "llama_tied_biases": ("LlamaConfig", dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                              vocab_size=100, intermediate_size=80, tie_word_embeddings=True,
                                              attention_bias=True, mlp_bias=True, head_dim=32)),
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=100, n_positions=32)),
    "qwen2": ("Qwen2Config", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=100, intermediate_size=96)),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hf_config_counts_what_transformers_builds(tmp_path, name):
    """The parameters (names, sizes, order) and stage-3 units counted from a saved config.json
    are those of transformers' model for it, built on the meta device."""
    transformers = pytest.importorskip("transformers")
    import torch

    cls, kwargs = CONFIGS[name]
    config = getattr(transformers, cls)(**kwargs)
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    counted, shape, _ = model_params(read_config(tmp_path / "config.json"))
    assert counted == ModelParams.of_module(model)
    assert counted.numel == sum(p.numel() for p in model.parameters())
    assert shape.layers == config.num_hidden_layers and shape.hidden == config.hidden_size


def _error(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        zeroshard_main(list(args))
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_errors_name_the_flag_or_key(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "intermediate_size": 96}))
    assert "argument --model" in (err := _error(capsys, "plan", "--model", str(config))) and "'vocab_size'" in err
    assert "argument --link: unknown link 'pcie9'" in _error(capsys, "plan", "--params", "8e9", "--link", "pcie9")
    assert "argument --gpu-memory" in _error(capsys, "plan", "--params", "8e9", "--gpu-memory", "80XB")
    assert "argument --shard-group: 3 must divide --gpus 8" in _error(capsys, "plan", "--params", "8e9",
                                                                      "--shard-group", "3")
    assert "--hidden, --layers and --heads go together" in _error(capsys, "plan", "--params", "8e9", "--hidden", "8")
    assert "one of the arguments --params --model --module is required" in _error(capsys, "plan")
    assert "argument --module" in _error(capsys, "plan", "--module", "no_such_package:build")
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": -1}}))
    assert "zero_optimization.reduce_bucket_size" in _error(capsys, "plan", "--params", "8e9", "--config", str(bad))


def test_frozen_flags_errors_name_the_flag(capsys, tmp_path):
    """--lora-rank, --lora-targets and --trainable-fraction: a bad value, a target the model has
    no Linear layer for, a combination that cannot be planned."""
    llama = ("plan", "--model", "llama-3-8b")
    assert "argument --lora-rank: '0' is not a whole number of at least 1" in _error(capsys, *llama, "--lora-rank", "0")
    assert "argument --trainable-fraction: '1.5' is not a fraction above 0 and at most 1" in \
        _error(capsys, *llama, "--trainable-fraction", "1.5")
    assert "argument --trainable-fraction: '0' is not a fraction" in _error(capsys, *llama, "--trainable-fraction", "0")
    assert "argument --trainable-fraction: not allowed with argument --lora-rank" in \
        _error(capsys, *llama, "--lora-rank", "8", "--trainable-fraction", "0.5")
    assert "argument --lora-targets: goes with --lora-rank" in _error(capsys, *llama, "--lora-targets", "q_proj")
    err = _error(capsys, *llama, "--lora-rank", "8", "--lora-targets", "q_proj,qkv_proj")
    assert "argument --lora-targets: qkv_proj names no Linear layer of the model" in err and "gate_proj" in err
    assert "argument --lora-targets: 'q_proj,,v proj' is not a list of module names" in \
        _error(capsys, *llama, "--lora-rank", "8", "--lora-targets", "q_proj,,v proj")
    assert "argument --lora-rank: a bare --params count has no layers" in \
        _error(capsys, "plan", "--params", "8e9", "--lora-rank", "8")
    assert "argument --model: cannot read llama-9b" in (err := _error(capsys, "plan", "--model", "llama-9b")) and \
        "llama-3-70b" in err
    frozen = tmp_path / "frozen_model.py"
    frozen.write_text("import torch\n\ndef build():\n    m = torch.nn.Linear(4, 4)\n"
                      "    m.bias.requires_grad_(False)\n    return m\n")
    sys.path.insert(0, str(tmp_path))
    try:
        assert "argument --lora-rank: the model already freezes 1 parameters (e.g. 'bias')" in \
            _error(capsys, "plan", "--module", "frozen_model:build", "--lora-rank", "2", "--lora-targets", "x")
    finally:
        sys.path.remove(str(tmp_path))


def test_commands_dispatch_and_usage_names_both(capsys, monkeypatch):
    assert zeroshard_main([]) == 2
    usage = capsys.readouterr().err
    assert "plan" in usage and "check" in usage and "a command is needed" in usage
    assert zeroshard_main(["deploy"]) == 2 and "unknown command 'deploy'" in capsys.readouterr().err
    seen = []
    fake = type(sys)("zeroshard.check")
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "zeroshard.check", fake)
    assert zeroshard_main(["check", "--sizes", "1MB"]) == 0 and seen == [["--sizes", "1MB"]]


def test_a_cli_error_exits_2_without_a_traceback():
    done = _cli("plan", "--params", "8e9", "--link", "warp-drive")
    assert done.returncode == 2 and "Traceback" not in done.stderr and "argument --link" in done.stderr


CARDS = ["--gpus", "4,8", "--gpu-memory", "24GB,48GB,80GB,141GB"]
README_PLANS = {
    "8e9": (["--params", "8e9", *CARDS, "--offload"], ["README.md"]),
    "7e10": (["--params", "7e10", *CARDS, "--offload"], ["docs/planner.md"]),
    # Llama-3-70B with LoRA on a frozen base: docs/planner.md's "Frozen parameters (LoRA)".
    "llama-3-70b-lora": (["--model", "llama-3-70b", "--lora-rank", "16", "--lora-targets", "q_proj,v_proj", *CARDS,
                          "--activation-checkpointing", "--offload"], ["docs/planner.md"]),
}


@pytest.mark.parametrize("plan", sorted(README_PLANS))
def test_the_documented_tables_are_the_planners(capsys, plan):
    args, pages = README_PLANS[plan]
    assert zeroshard_main(["plan", *args]) == 0
    table = "\n".join(line for line in capsys.readouterr().out.splitlines() if line.startswith("|"))
    for page in pages:
        text = (ROOT / page).read_text()
        assert f"python -m zeroshard plan {' '.join(args)}" in text, page
        assert table in text, f"{page}'s table for {plan} is not what the planner prints now"
