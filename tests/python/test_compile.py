"""engine.compile() (python/zeroshard/compiled.py): each unit's forward compiled in place with
inductor, zeroshard's hooks outside the graphs, at stages 0-3 on 2 Gloo ranks. Every stage runs
eagerly and compiled in one spawned pair of processes (spawn.SharedRuns)."""

import pytest

from compile_runs import STEPS, compiled_and_eager, config_section, deepspeed_compile
from spawn import SharedRuns

WORLD = 2
STAGES = (0, 1, 2, 3)
# 16-bit compute and an offloaded optimizer, compiled against the same run eagerly: (stage,
# dtype, offload) and how far the losses may differ (inductor fuses 16-bit ops in fp32, eager
# rounds after each op).
MIXED = {"stage3-bf16": ((3, "bf16", False), 2e-2), "stage2-fp16": ((2, "fp16", False), 5e-3),
         "stage2-offload": ((2, "fp32", True), 1e-5)}


@pytest.fixture(scope="module")
def runs():
    cases = {f"stage{s}": (compiled_and_eager, s) for s in STAGES}
    cases.update({name: (compiled_and_eager, *args) for name, (args, _) in MIXED.items()})
    cases["deepspeed"] = (deepspeed_compile,)
    cases["config"] = (config_section,)
    return SharedRuns({WORLD: cases}, timeout=900)


@pytest.mark.parametrize("stage", STAGES)
def test_compiled_units_train_as_eager_within_1e5(runs, stage):
    for rank, result in enumerate(runs.result(WORLD, f"stage{stage}")):
        eager, compiled = result["eager"], result["compiled"]
        assert compiled["names"] == ["blocks.0", "blocks.1"], f"rank {rank}: compiled {compiled['names']}"
        assert len(compiled["losses"]) == STEPS
        for step, (a, b) in enumerate(zip(eager["losses"], compiled["losses"])):
            assert abs(a - b) <= 1e-5, f"stage {stage} rank {rank} step {step}: eager {a} compiled {b}"


@pytest.mark.parametrize("stage", STAGES)
def test_no_recompilation_after_the_first_step(runs, stage):
    for rank, result in enumerate(runs.result(WORLD, f"stage{stage}")):
        graphs = result["compiled"]["graphs"]
        # The first step compiled (dynamo's count starts from zero for each compiled run), and
        # the steps after it ran the same graphs.
        # Both blocks share one graph (Note [hooks outside the graphs]: the parameters are
        # inputs, so the second block does not recompile).
        assert graphs[0] == 1, f"stage {stage} rank {rank}: {graphs[0]} graphs compiled for the two blocks"
        assert graphs[-1] == graphs[0], f"stage {stage} rank {rank}: unique graphs by step {graphs}"
        # The eager run compiled nothing (its counts are those of the runs before it).
        assert result["eager"]["graphs"][0] == result["eager"]["graphs"][-1]


@pytest.mark.parametrize("stage", STAGES)
def test_compiled_units_keep_the_memory_and_traffic_of_eager(runs, stage):
    for rank, result in enumerate(runs.result(WORLD, f"stage{stage}")):
        eager, compiled = result["eager"], result["compiled"]
        # The same gathers and releases (stage 3's gathered peak), the same buffers, the same
        # collectives: the hooks ran as they do eagerly.
        assert compiled["memory"] == eager["memory"], f"stage {stage} rank {rank}"
        assert compiled["comm"] == eager["comm"], f"stage {stage} rank {rank}"
        if stage == 3:
            assert compiled["released"] and all(compiled["released"]), "stage-3 units not released after use"
            assert eager["released"] == compiled["released"]


def test_deepspeed_engine_compile_trains_as_eager_and_refuses_deepcompile(runs):
    for rank, result in enumerate(runs.result(WORLD, "deepspeed")):
        assert result["is_compiled"] and not result["eager_is_compiled"]
        for step, (a, b) in enumerate(zip(result["eager"], result["compiled"])):
            assert abs(a - b) <= 1e-5, f"rank {rank} step {step}: eager {a} compiled {b}"
        assert "DeepCompile" in result["schedule_error"], result["schedule_error"]


@pytest.mark.parametrize("name", sorted(MIXED))
def test_compiled_units_in_16_bit_and_offloaded_train_as_eager(runs, name):
    (stage, dtype, offload), tolerance = MIXED[name]
    for rank, result in enumerate(runs.result(WORLD, name)):
        eager, compiled = result["eager"], result["compiled"]
        assert compiled["names"] == ["blocks.0", "blocks.1"], f"rank {rank}: compiled {compiled['names']}"
        assert compiled["graphs"][0] > 0 and compiled["graphs"][-1] == compiled["graphs"][0], compiled["graphs"]
        for step, (a, b) in enumerate(zip(eager["losses"], compiled["losses"])):
            assert abs(a - b) <= tolerance * max(1.0, abs(a)), f"{name} rank {rank} step {step}: eager {a} compiled {b}"
        assert compiled["memory"] == eager["memory"] and compiled["comm"] == eager["comm"], name


def test_the_config_compile_section_takes_effect(runs):
    for rank, result in enumerate(runs.result(WORLD, "config")):
        enabled = result["enabled"]
        # compile.enabled: initialize compiled the units with compile.backend, which ran.
        assert enabled["at_initialize"] == ["blocks.0", "blocks.1"], enabled
        assert enabled["graphs"] > 0, f"rank {rank}: compile.backend never compiled a graph"
        # compile.kwargs reach torch.compile: disable=True compiles nothing.
        assert result["disabled by kwargs"]["at_initialize"] == ["blocks.0", "blocks.1"]
        assert result["disabled by kwargs"]["graphs"] == 0, result["disabled by kwargs"]
        # Without enabled nothing is compiled at initialize; engine.compile() takes the section's backend.
        defaults = result["defaults of compile()"]
        assert defaults["at_initialize"] == [] and defaults["names"] == ["blocks.0", "blocks.1"], defaults
        assert defaults["graphs"] > 0
        assert result["off"]["at_initialize"] == [] and result["off"]["graphs"] == 0
        # A backend that runs the captured graphs as they are trains exactly as eagerly.
        for label in ("enabled", "disabled by kwargs", "defaults of compile()"):
            assert result[label]["losses"] == result["off"]["losses"], (label, result[label]["losses"])


def test_a_compiled_unit_copies_and_pickles_with_its_own_parameters():
    """copy.deepcopy of a compiled model (an EMA or teacher copy) is compiled and computes with
    the copy's parameters; torch.save / torch.load of it gives the same outputs, from units that
    say they are not compiled, and compile again."""
    import copy
    import io

    import torch

    from zeroshard.compiled import compile_units, is_compiled

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    assert compile_units(model, [("0", model[0]), ("2", model[2])], backend="eager") == ["0", "2"]
    x = torch.randn(3, 4)
    expected = model(x)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(2)
    reference = copy.deepcopy(model)  # the same weights, run eagerly
    for unit in (reference[0], reference[2]):
        del unit.forward
    with torch.no_grad():
        for p in reference.parameters():
            p.mul_(2)
    torch.testing.assert_close(twin(x), reference(x), rtol=0, atol=0)
    assert not torch.equal(twin(x), expected)
    assert is_compiled(twin[0]) and is_compiled(twin[2])
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(loaded(x), expected, rtol=0, atol=0)
    # pickle stores a bound method by name and finds the class's: the loaded units run eagerly,
    # say so, and compile again.
    assert not is_compiled(loaded[0]) and not is_compiled(loaded[2])
    assert compile_units(loaded, [("0", loaded[0])], backend="eager") == ["0"]
    assert is_compiled(loaded[0])
    torch.testing.assert_close(loaded(x), expected, rtol=0, atol=0)
