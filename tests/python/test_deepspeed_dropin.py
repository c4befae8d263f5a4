"""`import zeroshard.deepspeed as deepspeed`: a DeepSpeed script runs with the one changed import.

Held to: single-process torch AdamW with DeepSpeed's WarmupDecayLR formula on the batches
DeepSpeed's dataloader gives each rank (ds_script.py at stages 1-3, 2 ranks), DeepSpeed's
observed behaviour (counters, get_lr, boundaries, checkpoints, the dataloader, save_16bit_model,
GatheredParameters), and, where DeepSpeed is installed, DeepSpeed itself running the same script.
The three groups of cases below share one spawned pair of ranks (spawn.SharedRuns), each group
with its own result and failure.
"""

import argparse
import base64
import importlib.util
import json
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch

import zeroshard.deepspeed as deepspeed
from zeroshard.deepspeed.config import resolve_config
from ds_script import LanguageModel, TokenDataset
from spawn import SharedRuns
from deepspeed_runs import (GAS, LR, MICRO, SCHEDULE, STEPS, WD, WORLD, client_adamw, client_schedule,
                            dataloader_and_checkpoints, ds_config, gathered_parameters_and_16bit_model)
from training import AdamWReference

HERE = os.path.dirname(__file__)


def warmup_decay_lr(step):
    """DeepSpeed's WarmupDecayLR (warmup_type "log") for optimizer step `step`: the schedule is at
    iteration step - 1 (-1 before its first step(), which gives the minimum)."""
    it, low, high = step - 1, SCHEDULE["warmup_min_lr"], SCHEDULE["warmup_max_lr"]
    warmup, total = SCHEDULE["warmup_num_steps"], SCHEDULE["total_num_steps"]
    if it < 0:
        return low
    if it < warmup:
        gamma = math.log(it + 1) / math.log(warmup)
    else:
        gamma = max(0.0, (total - it) / max(1.0, total - warmup))
    return low + (high - low) * gamma


def rank_indices(size, world=WORLD):
    """What DeepSpeed's dataloader gives each rank: a shuffled DistributedSampler, seed 0."""
    data = range(size)
    return [list(torch.utils.data.DistributedSampler(data, num_replicas=world, rank=r, shuffle=True, seed=0))
            for r in range(world)]


def reference_run(steps=STEPS, gas=GAS):
    """Single-process torch.optim.AdamW on each step's global batch (every rank's micro-batches),
    with the schedule's lr: the losses of each step and the final weights."""
    torch.manual_seed(0)
    model = LanguageModel()
    data = TokenDataset(steps * MICRO * gas * WORLD)
    per_rank = rank_indices(len(data))
    reference = AdamWReference(model, lr=LR, weight_decay=WD, loss=lambda m, batch: m(batch))
    losses = []
    for step in range(steps):
        picked = [i for r in range(WORLD) for m in range(step * gas, (step + 1) * gas)
                  for i in per_rank[r][m * MICRO:(m + 1) * MICRO]]
        reference.set_lr(warmup_decay_lr(step))
        losses.append(reference.step(data.tokens[picked]))
    return losses, model.state_dict()


# ---- the script at stages 1-3 ------------------------------------------------------------


def _run_script_stages(rank, world, configs):
    import ds_script

    return {stage: ds_script.main(["--deepspeed_config", path, "--steps", str(STEPS)]) for stage, path in configs}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ds_script")
    configs = []
    for stage in (1, 2, 3):
        path = tmp / f"stage{stage}.json"
        path.write_text(json.dumps(ds_config(stage)))
        configs.append((stage, str(path)))
    return SharedRuns({WORLD: {
        "script": (_run_script_stages, configs),
        "behaviours": (dataloader_and_checkpoints, str(tmp_path_factory.mktemp("checkpoints"))),
        "gathered": (gathered_parameters_and_16bit_model, str(tmp_path_factory.mktemp("gathered"))),
    }})


@pytest.fixture(scope="module")
def script_records(runs):
    """ds_script.py's record at stages 1, 2 and 3 (rank 0's)."""
    return runs.result(WORLD, "script")[0]


def test_the_deepspeed_script_at_stages_1_to_3_matches_torch_adamw_with_the_schedule(script_records):
    losses, weights = reference_run()
    for stage, record in script_records.items():
        step_losses = [sum(record["loss"][s * GAS:(s + 1) * GAS]) / GAS for s in range(STEPS)]
        assert step_losses == pytest.approx(losses, rel=1e-5), stage
        for name, value in weights.items():
            torch.testing.assert_close(record["weights"][name], value, rtol=1e-4, atol=1e-5, msg=f"{stage} {name}")


def test_the_script_sees_deepspeeds_counters_lrs_and_boundaries(script_records):
    for stage, record in script_records.items():
        # get_lr() before each micro-step: the schedule's value for the coming optimizer step,
        # its start value (0) for the first two (warmup_type "log").
        assert record["lr"] == pytest.approx([warmup_decay_lr(m // GAS) for m in range(STEPS * GAS)]), stage
        assert record["lr"][:2 * GAS] == [0.0] * (2 * GAS)
        # Read after backward, the boundary alternates with accumulation 2; global_steps rises at it only.
        assert record["boundary"] == [m % GAS == GAS - 1 for m in range(STEPS * GAS)]
        assert record["global_steps"] == [(m + 1) // GAS for m in range(STEPS * GAS)]
        assert record["global_samples"] == STEPS * MICRO * GAS * WORLD


def test_deepspeed_itself_gives_the_same_numbers_for_the_script_at_stage_2(script_records, tmp_path):
    """DeepSpeed 0.19.8 on CPU (DS_ACCELERATOR=cpu, Gloo, torch AdamW) running ds_script.py."""
    if importlib.util.find_spec("deepspeed") is None:  # not imported here: it is slow to import
        pytest.skip("DeepSpeed is not installed")
    config = tmp_path / "stage2.json"
    config.write_text(json.dumps(ds_config(2)))
    out = tmp_path / "deepspeed.pt"
    env = dict(os.environ, DS_ACCELERATOR="cpu", DS_SCRIPT_BACKEND="deepspeed", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-port",
               str(_free_port()), os.path.join(HERE, "ds_script.py"), "--deepspeed_config", str(config),
               "--steps", str(STEPS), "--out", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    theirs, ours = torch.load(out), script_records[2]
    assert ours["lr"] == pytest.approx(theirs["lr"])
    assert ours["boundary"] == theirs["boundary"]
    assert ours["global_steps"] == theirs["global_steps"]
    assert ours["global_samples"] == theirs["global_samples"]
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
    for name, value in theirs["weights"].items():
        torch.testing.assert_close(ours["weights"][name], value, rtol=1e-4, atol=1e-5, msg=name)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the engine's DeepSpeed behaviours, on 2 ranks -----------------------------------------


@pytest.fixture(scope="module")
def behaviours(runs):
    return runs.result(WORLD, "behaviours")


def test_the_dataloader_is_deepspeeds_distributed_sampler_over_micro_batches(behaviours):
    indices = rank_indices(21)
    for rank, out in enumerate(behaviours):
        for drop_last, batches in ((False, 6), (True, 5)):  # 11 samples per rank in batches of 2
            loader = out[f"loader drop_last={drop_last}"]
            assert {k: loader[k] for k in ("sampler", "shuffle", "seed", "replicas", "rank", "batch", "drop_last")} \
                == dict(sampler="DistributedSampler", shuffle=True, seed=0, replicas=WORLD, rank=rank, batch=MICRO,
                        drop_last=drop_last)
            assert loader["indices"] == indices[rank] and loader["len"] == batches == len(loader["batches"])
            assert torch.equal(torch.cat(loader["batches"]), TokenDataset(21).tokens[indices[rank][:len(
                torch.cat(loader["batches"]))]])


def test_a_client_adamw_and_its_scheduler_are_taken_over(behaviours):
    out = behaviours[0]
    assert out["returned"] == dict(optimizer=True, scheduler=True)
    assert out["groups"] == [(LR, (0.8, 0.95), 1e-7, WD), (2e-3, (0.8, 0.95), 1e-7, 0.0)]
    assert any("'optimizer' section is not used" in w for w in out["warnings"])
    # Single-process torch: the same AdamW groups and LambdaLR on each step's global batch.
    torch.manual_seed(0)
    model = LanguageModel()
    optimizer = client_adamw(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, client_schedule)
    losses, lrs = [], []
    for step in range(4):
        window = range(step * GAS, (step + 1) * GAS)
        tokens = torch.cat([behaviours[r]["batches"][m] for r in range(WORLD) for m in window])
        lrs.append([g["lr"] for g in optimizer.param_groups])
        optimizer.zero_grad()
        loss = model(tokens)
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    trained_losses, trained_lrs = out["trained"]
    assert [sum(trained_losses[s * GAS:(s + 1) * GAS]) / GAS for s in range(4)] == pytest.approx(losses, rel=1e-5)
    assert trained_lrs == [lrs[m // GAS] for m in range(4 * GAS)]
    for name, value in model.state_dict().items():
        torch.testing.assert_close(out["weights"][name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_a_checkpoint_resumes_with_client_state_counters_lr_and_schedule(behaviours):
    for out in behaviours:
        assert out["saved"]["returned"] is True
        loaded = out["loaded"]
        assert os.path.basename(loaded["path"]) == "global_step2"
        assert loaded["state"] == {"epoch": 3, "note": "kept"}
        assert (loaded["global_steps"], loaded["global_samples"]) == (2, 2 * MICRO * GAS * WORLD)
        # The lr the saved run would have used next, and the scheduler's step count.
        assert loaded["lr"] == out["saved"]["at"] and loaded["sched"] == out["saved"]["sched"] == 2
        # ... and training continues exactly as the saved run did.
        assert out["resumed"] == (out["trained"][0][4:], out["trained"][1][4:])
        assert out["latest"] == b"global_step2"
        assert os.path.basename(out["aside"]) == "aside"
        assert out["empty"] == (None, None)
        # The same words on every rank: rank 0 says them.
        assert any("no checkpoint to load" in w for w in out["empty warnings"]) == (out is behaviours[0])


def test_the_config_schedule_resumes_from_a_checkpoint_where_it_was(behaviours):
    for out in behaviours:
        schedule = out["config schedule"]
        assert schedule["scheduler"] != "NoneType"  # initialize returns the config's schedule
        assert schedule["before"] == pytest.approx([warmup_decay_lr(0)])
        assert schedule["at save"] == schedule["at load"] == pytest.approx([warmup_decay_lr(2)])
        assert schedule["global_steps"] == 2
        lrs, state = schedule["scheduler at save"]
        assert lrs == pytest.approx([warmup_decay_lr(2)]) and state == {"last_batch_iteration": 1}
        # The same lrs (warmup end, then decay) and losses as the run that went on.
        lrs = [lr for (lr,) in schedule["trained"][1]]
        assert lrs == pytest.approx([warmup_decay_lr(2 + m // GAS) for m in range(2 * GAS)])
        assert schedule["resumed"] == schedule["trained"]


@pytest.fixture(scope="module")
def gathered(runs):
    return runs.result(WORLD, "gathered")


@pytest.mark.parametrize("stage", [1, 3])
def test_gathered_parameters_modified_on_rank_0_reach_every_rank_and_the_fp32_masters(gathered, stage):
    for rank, out in enumerate(gathered):
        result = out[stage]
        # A model cast to bf16 before initialize: the masters are its values, as in DeepSpeed.
        assert all(torch.equal(result["initial masters"][k], result["start"][k]) for k in result["initial masters"])
        # Read: whole, the 16-bit weights of the masters.
        for name, value in result["read"].items():
            assert value.shape == result["start"][name].shape
            assert torch.equal(value, result["before"][name].to(torch.bfloat16)), name
        if stage == 3:
            assert torch.equal(result["after read-only change"], result["before"]["embed.weight"])
        # Modified on rank 0: rank 0's value everywhere, in the masters and the compute copy;
        # every other master exactly as it was (listed, not changed: not rounded to bf16).
        assert torch.equal(result["after"]["embed.weight"], torch.full_like(result["after"]["embed.weight"], 0.5))
        assert torch.equal(result["compute after"], torch.full_like(result["compute after"], 0.5))
        for name in result["before"]:
            if name != "embed.weight":
                assert torch.equal(result["after"][name], result["before"][name]), name
    # The ranks stay in step: the same weights after training on.
    for name, value in gathered[0][stage]["weights after"].items():
        assert torch.equal(gathered[1][stage]["weights after"][name], value), name


def test_save_16bit_model_writes_pytorch_model_bin_under_the_modules_names(gathered):
    result = gathered[0][1]
    assert result["saved"] is True and result["files"] == ["pytorch_model.bin"]
    saved = torch.load(os.path.join(gathered[0]["dir"], "stage1", "pytorch_model.bin"))
    assert list(saved) == list(result["state_dict"])
    for name, value in saved.items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, result["state_dict"][name]), name
    # Stage 3 without stage3_gather_16bit_weights_on_model_save: nothing written, False, a warning.
    result = gathered[0][3]
    assert result["saved"] is False and result["files"] == []
    assert any("stage3_gather_16bit_weights_on_model_save" in w for w in result["save warnings"])
    assert gathered[0]["gathered"]["saved"] is True and gathered[0]["gathered"]["files"] == ["pytorch_model.bin"]


# ---- in one process: what fails before any rank is involved ---------------------------------


def test_add_config_arguments_adds_deepspeeds_flags():
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert (args.deepspeed, args.deepspeed_config, args.deepscale, args.deepscale_config) == (True, "ds.json", False,
                                                                                             None)


def test_the_config_is_found_as_deepspeed_finds_it(tmp_path):
    written = tmp_path / "ds.json"
    written.write_text('{"train_micro_batch_size_per_gpu": 2}')
    args = argparse.Namespace(deepspeed_config=str(written))
    assert resolve_config(args, None, None)[0] == {"train_micro_batch_size_per_gpu": 2}
    assert resolve_config(None, {"a": 1}, {"b": 2})[0] == {"a": 1}  # config wins over config_params
    assert resolve_config(None, None, {"b": 2})[0] == {"b": 2}
    encoded = base64.urlsafe_b64encode(b'{"c": 3}').decode()
    assert resolve_config(None, encoded, None)[0] == {"c": 3}
    commented = tmp_path / "commented.json"
    commented.write_text('{\n  // hjson, as DeepSpeed reads it\n  "d": 4,\n}')
    pytest.importorskip("hjson")
    assert resolve_config(None, str(commented), None)[0] == {"d": 4}
    model = LanguageModel()
    with pytest.raises(ValueError, match="both as args.deepspeed_config"):
        deepspeed.initialize(args=args, model=model, config={"a": 1})
    with pytest.raises(ValueError, match="--deepspeed_config"):
        deepspeed.initialize(model=model)
    (tmp_path / "twice.json").write_text('{"a": 1, "a": 2}')
    with pytest.raises(ValueError, match="duplicate key 'a'"):
        deepspeed.initialize(model=model, config=str(tmp_path / "twice.json"))
    with pytest.raises(ValueError, match="neither an existing file"):
        deepspeed.initialize(model=model, config=str(tmp_path / "missing.json"))


def test_an_optimizer_zeroshard_cannot_run_is_refused_by_name():
    model = LanguageModel()
    config = ds_config(1)
    with pytest.raises(TypeError, match=r"optimizer torch\.optim\.sgd\.SGD is not supported"):
        deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    with pytest.raises(ValueError, match=r"torch\.optim\.Adam with weight_decay=0\.01 .*\(L2\)"):
        deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), weight_decay=0.01),
                             config=config)
    with pytest.raises(ValueError, match="amsgrad=True"):
        deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), amsgrad=True), config=config)
    with pytest.raises(TypeError, match=r"torch\.optim\.sgd\.SGD"):  # a callable's result too
        deepspeed.initialize(model=model, optimizer=lambda params: torch.optim.SGD(params, lr=0.1), config=config)


def test_zero_init_builds_the_model_whole_and_says_so():
    with pytest.warns(UserWarning, match="builds the model whole"):
        with deepspeed.zero.Init(config_dict_or_path={}, enabled=True):
            model = LanguageModel()
    assert model.embed.weight.shape == (37, 24)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with deepspeed.zero.Init(enabled=False):
            LanguageModel()
