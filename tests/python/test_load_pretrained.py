"""engine.load_pretrained: safetensors files written by the `safetensors` package (as a Hugging Face
checkpoint is) load by state-dict name into a freshly built engine at every stage and world size,
each rank reading only what it holds; the loaded state is the file's exactly, and training then
continues bitwise as an engine built normally from those weights.

The model is StatefulTransformer (a head tied to the embedding, a frozen parameter, a float and a
long buffer), built normally or on the meta device: its files leave out the tied head, as
save_pretrained does.

To keep CI short (starting processes costs more than the cases), everything runs in one spawn of
4 real processes (Gloo), world sizes 1 and 2 on subgroups of it at the same time: ranks 0 and 1
run the 2-rank cases together, ranks 2 and 3 share out the 1-rank cases, then all four run the
4-rank ones (_rank_cases).
"""

import json

import pytest
import torch

from checkpoint_runs import GLOBAL
from checkpoint_runs import config as _config
from model_state import padded_numel
from models import global_batch, make_stateful_model
from spawn import run_ranks

TIED = "head.weight"  # the second name of embed.weight
STAGES = (0, 1, 2, 3)
FROZEN = ("frozen", "temperature", "steps")  # module state: a frozen parameter and the buffers


def _source():
    """The pretrained weights: make_stateful_model(0)'s state dict with its buffers moved off the
    values a new model starts with, without the tied head."""
    state = {k: v.detach().clone() for k, v in make_stateful_model(0).state_dict().items() if k != TIED}
    state["temperature"].fill_(1.25)
    state["steps"].fill_(5)
    return state


def _bf16(state):
    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}


def _file_bytes(state):
    """Tensor bytes in a file of `state`: trained parameters, and module state."""
    trained = sum(v.numel() * v.element_size() for k, v in state.items() if k not in FROZEN)
    return trained, sum(state[k].numel() * state[k].element_size() for k in FROZEN)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("pretrained")
    fp32 = _source()
    save_file(fp32, root / "fp32.safetensors")
    (root / "bf16").mkdir()
    save_file(_bf16(fp32), root / "bf16" / "model.safetensors")
    # A Hugging Face sharded checkpoint: two shards and the index naming them.
    (root / "sharded").mkdir()
    names = list(fp32)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, part in shards.items():
        save_file({k: fp32[k] for k in part}, root / "sharded" / shard)
    index = {"metadata": {"total_size": sum(_file_bytes(fp32))},
             "weight_map": {k: shard for shard, part in shards.items() for k in part}}
    (root / "sharded" / "model.safetensors.index.json").write_text(json.dumps(index))
    # Every kind of problem: a missing tensor, an unexpected one and one of another shape.
    bad = {k: v for k, v in fp32.items() if k != "norm.bias"}
    bad["extra.weight"] = torch.ones(3)
    bad["odd"] = fp32["odd"][:52].clone()
    save_file(bad, root / "bad.safetensors")
    # Every name under a prefix, as a checkpoint of a wrapping model stores them.
    save_file({f"transformer.{k}": v for k, v in fp32.items()}, root / "renamed.safetensors")
    return {"renamed": str(root / "renamed.safetensors"), "root": str(root), "fp32": str(root / "fp32.safetensors"), "bf16": str(root / "bf16"),
            "sharded": str(root / "sharded"), "index": str(root / "sharded" / "model.safetensors.index.json"),
            "bad": str(root / "bad.safetensors")}


def _expected(file_key):
    """What the engine must hold after loading the file: its values in fp32 (buffers in their own
    dtype), under every state-dict name."""
    state = _bf16(_source()) if file_key == "bf16" else _source()
    out = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    out[TIED] = out["embed.weight"]
    return out


def _differing(state, expected):
    return [k for k in expected if state[k].dtype != expected[k].dtype or not torch.equal(state[k], expected[k])]


def _train(model, engine, group, steps=2):
    """This rank's losses over `steps` global batches (the group's ranks share each)."""
    import torch.distributed as dist

    rank, micro = dist.get_rank(group), GLOBAL // dist.get_world_size(group)
    losses = []
    for step in range(steps):
        loss = model.loss(global_batch(step, GLOBAL)[rank * micro:(rank + 1) * micro])
        engine.backward(loss)
        assert engine.step()
        model.advance()
        losses.append(loss.item())
    return losses


def _no_init(module):
    """A meta model's init_fn when its weights are loaded next: nothing to draw."""


def _engine(model, group, stage, precision, persistence=0):
    import torch.distributed as dist
    import zeroshard

    config = _config(dist.get_world_size(group), stage, precision)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = persistence
    meta = next(model.parameters()).is_meta
    return zeroshard.initialize(model, config, process_group=group, init_fn=_no_init if meta else None)


def _load_case(group, stage, precision, path, file_key, persistence, build):
    """Loads `path` into an engine of a differently seeded model (or one built on the meta device),
    and builds a reference engine the ordinary way from the expected weights; trains both two
    steps."""
    expected = _expected(file_key)
    if build == "meta":
        with torch.device("meta"):
            model = make_stateful_model(1)
    else:
        model = make_stateful_model(1)
    engine = _engine(model, group, stage, precision, persistence)
    loaded = engine.load_pretrained(path)
    out = {"loaded": loaded, "stats": engine.last_load_stats(),
           "units": [(u["numel"], u["persistent_numel"]) for u in engine.stage3_units()],
           "frozen_units": [u["frozen_numel"] for u in engine.stage3_units()],
           "wrong": _differing(engine.full_state_dict(dtype=torch.float32), expected)}
    reference_model = make_stateful_model(2)
    reference_model.load_state_dict(expected)
    reference = _engine(reference_model, group, stage, precision, persistence)
    # The compute-dtype copies (at stage 3 the shards the next gather reads) are the reference's.
    out["wrong_compute"] = _differing(engine.full_state_dict(), reference.full_state_dict())
    out["losses"] = _train(model, engine, group)
    out["reference_losses"] = _train(reference_model, reference, group)
    out["wrong_trained"] = _differing(engine.full_state_dict(dtype=torch.float32),
                                      reference.full_state_dict(dtype=torch.float32))
    return out


def _problems(group, files):
    """strict=True on a file with all three problems changes nothing; strict=False loads the rest.
    Then the other errors."""
    model = make_stateful_model(1)
    engine = _engine(model, group, 3, "bf16")
    before, before_compute = engine.full_state_dict(dtype=torch.float32), engine.full_state_dict()
    out = {}
    try:
        engine.load_pretrained(files["bad"])
    except RuntimeError as e:
        out["strict_error"] = str(e)
    out["changed_by_strict"] = _differing(engine.full_state_dict(dtype=torch.float32), before)
    out["compute_changed_by_strict"] = _differing(engine.full_state_dict(), before_compute)
    # A buffer replaced since initialize (a reassigned attribute) is the one loaded into.
    model.temperature = torch.zeros(())
    out["loaded"] = engine.load_pretrained(files["bad"], strict=False)
    expected = _expected("fp32")
    for kept in ("norm.bias", "odd"):
        expected[kept] = before[kept]
    out["wrong_non_strict"] = _differing(engine.full_state_dict(dtype=torch.float32), expected)
    out["temperature"] = model.temperature.item()
    for name, path in (("nothing", files["root"] + "/nothing"), ("no_checkpoint", files["root"])):
        try:
            engine.load_pretrained(path)
        except RuntimeError as e:
            out[name] = str(e)
    out["renamed_without_mapping"] = engine.load_pretrained(files["renamed"], strict=False)
    # key_mapping's patterns apply in turn: the second sees the first's result.
    out["renamed"] = engine.load_pretrained(files["renamed"], key_mapping={r"^transformer\.": "model.",
                                                                       r"^model\.": ""})
    out["wrong_renamed"] = _differing(engine.full_state_dict(dtype=torch.float32), _expected("fp32"))
    # A rename onto a name another tensor of the file has, and one onto no name of the model.
    for name, path, mapping in (("collision", files["fp32"], {r"^norm\.weight$": "norm.bias"}),
                                ("unknown", files["bad"], {r"^extra\.": "more.", r"^norm\.weight$": "norm.bias"}),
                                ("reshaped", files["bad"], {r"^extra\.weight$": "odd"})):
        try:
            engine.load_pretrained(path, key_mapping=mapping)
        except RuntimeError as e:
            out[name] = str(e)
    engine.backward(model.loss(torch.zeros(2, 9, dtype=torch.long)))
    try:
        engine.load_pretrained(files["fp32"])
    except RuntimeError as e:
        out["inside_window"] = str(e)
    return out


def _cases(world_size):
    """(stage, precision, file, stage3_param_persistence_threshold, build): persistence 100 keeps
    the biases, norms and `odd` gathered, which every rank then reads whole; "meta" builds the
    model on the meta device, so the file gives it its only values."""
    if world_size == 4:
        return [(3, "fp32", "fp32", 0, "normal"), (3, "bf16", "bf16", 0, "normal"), (3, "bf16", "fp32", 100, "normal"),
                (3, "fp32", "bf16", 0, "meta")]
    cases = [(stage, precision, file_key, 0, "normal") for stage in STAGES for precision in ("fp32", "bf16")
             for file_key in ("fp32", "bf16")]
    if world_size == 1:
        cases += [(2, "bf16", "bf16", 0, "meta")]
    if world_size == 2:
        cases += [(1, "fp16", "fp32", 0, "normal"), (3, "fp16", "bf16", 0, "normal"),
                  (3, "fp32", "bf16", 100, "normal"), (0, "fp32", "sharded", 0, "normal"),
                  (3, "fp32", "index", 0, "normal"), (0, "fp32", "bf16", 0, "meta"), (3, "bf16", "fp32", 100, "meta")]
    return cases


def _run(group, files, cases):
    return {case: _load_case(group, stage, precision, files[key], "bf16" if key == "bf16" else "fp32", *rest)
            for case in cases for stage, precision, key, *rest in [case]}


def _rank_cases(rank, world_size, files):
    """{world size: {case: result}} for the cases this rank took part in."""
    import torch.distributed as dist

    assert world_size == 4
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    singles = [dist.new_group([r]) for r in range(4)]
    out = {}
    if rank < 2:
        out[2] = _run(pairs[0], files, _cases(2))
        out[2]["problems"] = _problems(pairs[0], files)
    else:
        out[1] = _run(singles[rank], files, _cases(1)[rank - 2::2])
    dist.barrier()  # the world group's long timeout, not the engines' short one, covers the wait
    out[4] = _run(dist.group.WORLD, files, _cases(4))
    return out


@pytest.fixture(scope="module")
def runs(files):
    """runs(world_size): each rank's {case: result} at that world size (at 1, one "rank" holding
    every case)."""
    results = run_ranks(_rank_cases, 4, files, timeout=300)
    by_world = {4: [r[4] for r in results], 2: [r[2] for r in results[:2]],
                1: [results[2][1] | results[3][1]]}
    return by_world.__getitem__


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_the_engine_holds_the_files_values_exactly_at_every_stage(runs, world_size):
    for rank, results in enumerate(runs(world_size)):
        for case in _cases(world_size):
            r = results[case]
            assert r["loaded"] == ([], [], []), (rank, case)
            assert r["wrong"] == [], (rank, case)
            assert r["wrong_compute"] == [], (rank, case)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_training_continues_bitwise_as_from_an_engine_built_from_the_weights(runs, world_size):
    for rank, results in enumerate(runs(world_size)):
        for case in _cases(world_size):
            r = results[case]
            assert r["losses"] == r["reference_losses"], (rank, case)
            assert r["wrong_trained"] == [], (rank, case)


@pytest.mark.parametrize("world_size", [2, 4])
def test_at_stage_3_each_rank_reads_exactly_its_slices(runs, world_size):
    results = runs(world_size)
    for case in _cases(world_size):
        if case[0] != 3 or case[2] not in ("fp32", "bf16"):
            continue
        state = _bf16(_source()) if case[2] == "bf16" else _source()
        trained, module_state = _file_bytes(state)
        element = state["embed.weight"].element_size()
        units = results[0][case]["units"]
        for rank, r in enumerate(results):
            # Each unit is laid out back to back and padded at its end; rank r holds [r S, (r+1) S).
            # Persistent parameters are kept whole on every rank.
            held = 0
            for numel, persistent in units:
                shard = padded_numel(numel, world_size) // world_size
                held += max(0, min(numel, (rank + 1) * shard) - rank * shard) + persistent
            # A frozen parameter over the threshold is sharded with its unit: this rank's slice.
            frozen = state["frozen"]
            frozen_held = frozen.numel() if not any(r[case]["frozen_units"]) else 0
            for numel in r[case]["frozen_units"]:
                shard = padded_numel(numel, world_size) // world_size
                frozen_held += max(0, min(numel, (rank + 1) * shard) - rank * shard)
            module_held = module_state - (frozen.numel() - frozen_held) * frozen.element_size()
            stats = r[case]["stats"]
            assert stats["param_bytes_read"] == held * element, (rank, case)
            assert stats["module_state_bytes_read"] == module_held, (rank, case)
            assert stats["bytes_read"] == (stats["param_bytes_read"] + module_held + stats["header_bytes_read"])
        persistent = sum(p for _, p in units) * element
        assert persistent > 0 if case[3] else persistent == 0
        # The ranks together read every parameter once (the persistent ones once each).
        total = sum(r[case]["stats"]["param_bytes_read"] for r in results)
        assert total == trained + (world_size - 1) * persistent, case


@pytest.mark.parametrize("world_size", [1, 2])
def test_below_stage_3_every_rank_reads_every_parameter_once(runs, world_size):
    for results in runs(world_size):
        for case in _cases(world_size):
            if case[0] < 3 and case[2] in ("fp32", "bf16"):
                state = _bf16(_source()) if case[2] == "bf16" else _source()
                assert results[case]["stats"]["param_bytes_read"] == _file_bytes(state)[0], case


def test_a_sharded_checkpoint_loads_from_its_directory_and_its_index(runs, files):
    for results in runs(2):
        for case in ((0, "fp32", "sharded", 0, "normal"), (3, "fp32", "index", 0, "normal")):
            assert [p.rsplit("/", 1)[1] for p in results[case]["stats"]["files"]] == [
                "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_strict_lists_all_three_problems_naming_the_file_and_changes_nothing(runs, files):
    for r in (results["problems"] for results in runs(2)):
        error = r["strict_error"]
        assert f"'{files['bad']}' does not fit the model (strict=True)" in error
        assert "1 missing: norm.bias;" in error and "1 unexpected: extra.weight;" in error
        assert "1 with another shape: odd (file [52], model [53]); load_pretrained(path, strict=False)" in error
        assert error.endswith("nothing was loaded on any rank")
        assert r["changed_by_strict"] == [] and r["compute_changed_by_strict"] == []


def test_strict_false_loads_what_fits_and_returns_the_three_lists(runs):
    import zeroshard

    for r in (results["problems"] for results in runs(2)):
        assert isinstance(r["loaded"], zeroshard.PretrainedLoad)
        assert r["loaded"] == (["norm.bias"], ["extra.weight"], [("odd", (52,), (53,))])
        assert r["loaded"].missing_keys == ["norm.bias"]
        assert r["wrong_non_strict"] == [] and r["temperature"] == 1.25


def test_errors_name_the_path_and_the_call_must_come_between_steps(runs, files):
    for r in (results["problems"] for results in runs(2)):
        assert f"'{files['root']}/nothing' does not exist" in r["nothing"]
        assert f"directory '{files['root']}' holds neither model.safetensors nor" in r["no_checkpoint"]
        assert "load_pretrained() must be called between optimizer steps" in r["inside_window"]


def test_key_mapping_renames_the_files_tensors_before_matching(runs, files):
    for r in (results["problems"] for results in runs(2)):
        # Without the mapping nothing fits (and nothing is loaded with strict=False).
        missing, unexpected, _ = r["renamed_without_mapping"]
        assert sorted(unexpected) == sorted(f"transformer.{k}" for k in _source())
        assert TIED not in missing and set(missing) == set(_source())
        assert r["renamed"] == ([], [], []) and r["wrong_renamed"] == []


def test_a_rename_onto_a_taken_or_unknown_name_is_reported_with_both_names(runs, files):
    for r in (results["problems"] for results in runs(2)):
        # The file's own norm.bias comes first in its header, so the renamed norm.weight is extra.
        assert "1 missing: norm.weight; 1 unexpected: norm.weight (as norm.bias);" in r["collision"]
        # bad.safetensors lacks norm.bias: the renamed norm.weight fills it; extra.weight is still extra.
        assert "1 missing: norm.weight; 1 unexpected: extra.weight (as more.weight);" in r["unknown"]
        assert r["unknown"].endswith("nothing was loaded on any rank")
        # extra.weight comes before the file's own odd: it is taken as odd, with its shape.
        assert ("1 unexpected: odd; 1 with another shape: extra.weight (as odd; file [3], model [53]);"
                in r["reshaped"])
