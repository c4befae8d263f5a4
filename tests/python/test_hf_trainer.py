"""zeroshard.hf: the Hugging Face Trainer and TRL's SFTTrainer training through zeroshard at 2
ranks equal the plain Trainer (DDP) at 2 ranks; checkpoints, resume, the saved model, evaluate,
predict and generate work as the Trainer's do (hf_runs.py runs them).

One spawned run per world size holds every case of that world size (spawn.SharedRuns).
"""

import json
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from hf_runs import (auto_case, checkpoint_case, pretrained_case, save_model_case, sft_case, sft_dataset,  # noqa: E402
                     tiny_llama, train_case)
from spawn import SharedRuns  # noqa: E402

pytest.importorskip("transformers")
pytest.importorskip("trl")

STAGES = (0, 1, 2, 3)
TOL = 1e-5


class _Runs(SharedRuns):
    def result(self, world_size, name):
        if world_size == 1:
            # Its resume reads the checkpoint the 2-rank run saved: that one is spawned first.
            try:
                super().result(2, "checkpoint_stage3")
            except AssertionError:
                pass  # the resume says what it misses
        return super().result(world_size, name)


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("hf")


@pytest.fixture(scope="module")
def pretrained(out):
    """The tiny Llama (the one every run starts from) saved as a Hugging Face model folder."""
    tiny_llama().save_pretrained(out / "pretrained")
    return out / "pretrained"


@pytest.fixture(scope="module")
def runs(out, pretrained):
    two = {"ddp": (train_case, str(out / "ddp"), "ddp", None)}
    two.update({f"stage{s}": (train_case, str(out / f"stage{s}"), "zeroshard", s) for s in STAGES})
    two["sft_ddp"] = (sft_case, str(out / "sft_ddp"), "ddp", None)
    two["sft_stage3"] = (sft_case, str(out / "sft_stage3"), "zeroshard", 3)
    two["pretrained_stage3"] = (pretrained_case, str(out / "pretrained_run"), str(pretrained), 3)
    two["sft_pretrained_stage3"] = (sft_case, str(out / "sft_pretrained"), "zeroshard", 3, str(pretrained))
    two["auto_template"] = (auto_case, str(out / "auto"))
    two["save_stage3"] = (save_model_case, str(out / "save_stage3"), 3, True)
    two["save_stage3_sharded"] = (save_model_case, str(out / "save_sharded"), 3, False)
    two["checkpoint_stage3"] = (checkpoint_case, str(out / "ckpt"), 3)
    two["resume_stage3"] = (checkpoint_case, str(out / "resumed"), 3, str(out / "ckpt" / "checkpoint-4"))
    # The same global batch on one rank (4 micro-batches a window), at stage 2.
    one = {"resume_one_rank": (checkpoint_case, str(out / "resumed_one"), 2, str(out / "ckpt" / "checkpoint-4"), 4)}
    return _Runs({2: two, 1: one}, timeout=120)


def _close(a, b, tol=TOL):
    return abs(a - b) <= tol * max(1.0, abs(b))


def _assert_logs_match(got, want):
    assert [g[0] for g in got] == [w[0] for w in want]
    for (step, loss, norm, lr), (_, loss_w, norm_w, lr_w) in zip(got, want):
        assert _close(loss, loss_w), f"step {step}: loss {loss} vs the plain Trainer's {loss_w}"
        assert _close(norm, norm_w), f"step {step}: grad_norm {norm} vs {norm_w}"
        assert lr == pytest.approx(lr_w, rel=1e-12, abs=1e-15), f"step {step}: learning_rate {lr} vs {lr_w}"


def _assert_weights_match(got, want, tol=TOL):
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("stage", STAGES)
def test_trainer_matches_the_plain_trainer_at_two_ranks(runs, stage):
    """Logged loss, grad_norm and learning_rate at every step and the final weights equal the
    plain Trainer's (DDP) within 1e-5, at stages 0-3, with accumulation (a short last window each
    epoch) and clipping (max_grad_norm 0.3 clips every step)."""
    ddp = runs.result(2, "ddp")[0]
    got = runs.result(2, f"stage{stage}")
    _assert_logs_match(got[0]["logs"], ddp["logs"])
    assert len(got[0]["logs"]) == 6
    assert all(norm > 0.3 for _, _, norm, _ in ddp["logs"])  # clipping acts on every step
    _assert_weights_match(got[0]["weights"], ddp["weights"])
    _assert_weights_match(got[1]["weights"], ddp["weights"])


@pytest.mark.parametrize("stage", STAGES)
def test_evaluate_and_predict_equal_the_plain_trainer(runs, stage):
    ddp = runs.result(2, "ddp")[0]
    got = runs.result(2, f"stage{stage}")[0]
    assert _close(got["eval_before"], ddp["eval_before"])  # the engine built by evaluate() trains on
    assert _close(got["eval_loss"], ddp["eval_loss"])
    torch.testing.assert_close(got["predictions"], ddp["predictions"], rtol=TOL, atol=TOL)


def test_generate_at_stage3_gives_the_whole_model_tokens(runs):
    for rank_result in runs.result(2, "stage3"):
        assert torch.equal(rank_result["generated"], rank_result["generated_whole"])
        assert rank_result["generated"].shape[1] == 4 + 6


def test_checkpoints_are_trainer_folders_with_the_sharded_checkpoint(runs):
    """save_steps=2, save_total_limit=2 over 6 steps: checkpoint-4 and -6 remain, each with the
    Trainer's files and zeroshard's checkpoint (global_step<N> and latest)."""
    saved = runs.result(2, "checkpoint_stage3")[0]
    assert [f for f in saved["folders"] if f.startswith("checkpoint-")] == ["checkpoint-4", "checkpoint-6"]
    files = set(saved["checkpoint_files"])
    for name in ("trainer_state.json", "rng_state_0.pth", "rng_state_1.pth", "scheduler.pt", "latest",
                 "global_step6", "model.safetensors", "config.json", "training_args.bin"):
        assert name in files, f"{name} missing from checkpoint-6: {sorted(files)}"


def test_resume_is_bitwise_equal_to_the_uninterrupted_run(runs):
    saved = runs.result(2, "checkpoint_stage3")
    resumed = runs.result(2, "resume_stage3")
    for rank in range(2):
        for name, value in saved[rank]["weights"].items():
            assert torch.equal(resumed[rank]["weights"][name], value), name
    # Steps 1-4 come back from checkpoint-4's trainer_state.json; 5 and 6 are computed again.
    assert resumed[0]["logs"] == saved[0]["logs"]


def test_resume_at_one_rank_and_stage2_continues_the_run(runs):
    """checkpoint-4 of the 2-rank stage-3 run, resumed on 1 rank at stage 2 with 4 accumulation
    steps (the same global batches): the remaining steps and final weights as uninterrupted."""
    saved = runs.result(2, "checkpoint_stage3")[0]
    resumed = runs.result(1, "resume_one_rank")[0]
    _assert_logs_match(resumed["logs"], saved["logs"])  # steps 1-4 from checkpoint-4's trainer_state.json
    _assert_weights_match(resumed["weights"], saved["weights"])


def test_save_model_writes_a_from_pretrained_folder(runs, out):
    import transformers

    saved = runs.result(2, "save_stage3")[0]
    assert {"model.safetensors", "config.json"} <= set(saved["files"])
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out / "save_stage3")
    _assert_weights_match({k: v.float() for k, v in loaded.state_dict().items()}, saved["weights"], tol=0)


def test_save_model_at_stage3_without_the_gather_flag_writes_the_sharded_checkpoint(runs):
    saved = runs.result(2, "save_stage3_sharded")[0]
    assert "model.safetensors" not in saved["files"]
    assert "latest" in saved["files"] and "config.json" in saved["files"]
    assert any("stage3_gather_16bit_weights_on_model_save" in w for w in saved["warnings"])


def test_sft_trainer_with_lora_matches_the_plain_sft_trainer(runs):
    ddp = runs.result(2, "sft_ddp")[0]
    got = runs.result(2, "sft_stage3")[0]
    _assert_logs_match(got["logs"], ddp["logs"])
    _assert_weights_match(got["weights"], ddp["weights"])
    assert got["weights"], "no adapter weights compared"


def test_sft_trainer_saves_the_adapter_that_peft_loads(runs, out):
    import peft

    got = runs.result(2, "sft_stage3")[0]
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(got["files"])
    assert "model.safetensors" not in got["files"]
    with open(out / "sft_stage3" / "adapter_config.json") as f:
        assert json.load(f)["r"] == 4
    model = peft.PeftModel.from_pretrained(tiny_llama(), out / "sft_stage3")
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(sft_dataset(2, seed=21)["input_ids"])).logits
    torch.testing.assert_close(logits, got["logits"], rtol=1e-5, atol=1e-5)


def test_from_pretrained_reads_each_ranks_slices_and_trains_as_the_whole_model(runs):
    """zeroshard.hf.from_pretrained builds on the meta device; the engine reads each rank's stage-3
    slices (the persistent norms whole on both): the bytes read over the ranks are the model's
    once plus the norms once more, and the run equals the plain Trainer on the same weights."""
    ddp = runs.result(2, "ddp")[0]
    got = runs.result(2, "pretrained_stage3")
    model = tiny_llama()
    total = sum(p.nbytes for p in model.parameters())
    persistent = sum(p.nbytes for p in model.parameters() if p.numel() <= 40)
    assert all(r["on_meta"] for r in got)
    assert sum(r["read"] for r in got) == total + persistent
    assert all(r["read"] < total for r in got)
    _assert_logs_match(got[0]["logs"], ddp["logs"])
    _assert_weights_match(got[0]["weights"], ddp["weights"])


def test_sft_with_lora_on_a_from_pretrained_model(runs, pretrained):
    """peft on the meta model: the base is read under peft's names, the adapters start as peft
    starts them (B zero, so the first loss is the base model's), and training matches DDP's first step."""
    from safetensors.torch import load_file

    ddp = runs.result(2, "sft_ddp")[0]
    got = runs.result(2, "sft_pretrained_stage3")[0]
    saved = load_file(pretrained / "model.safetensors")
    initial = got["initial"]
    for name, value in initial.items():
        if "lora_B" in name:
            assert not value.any(), name
        elif "lora_A" not in name:
            base = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            assert torch.equal(value, saved[base].float()), name
    assert _close(got["logs"][0][1], ddp["logs"][0][1])
    assert len(got["logs"]) == len(ddp["logs"])


def test_auto_values_come_from_the_training_arguments(runs):
    """Hugging Face's template (every Trainer-owned value "auto", a DeepSpeed WarmupDecayLR):
    the engine runs with the arguments' batch sizes, clipping and AdamW, and the schedule's
    warm-up and total steps are the Trainer's."""
    from hf_runs import LR, MAX_GRAD_NORM, MICRO, WEIGHT_DECAY

    got = runs.result(2, "auto_template")[0]
    assert (got["train_batch_size"], got["micro"], got["accumulation"]) == (2 * MICRO * 2, MICRO, 2)
    assert got["clipping"] == MAX_GRAD_NORM
    assert got["betas"] == (0.9, 0.999) and got["eps"] == 1e-8 and got["weight_decay"] == WEIGHT_DECAY
    assert got["schedule"] == "WarmupDecayLR"
    hidden = 32  # the model's hidden_size: Hugging Face's rules for the bucket sizes
    assert got["buckets"] == (hidden * hidden, int(0.9 * hidden * hidden), 10 * hidden)
    # DeepSpeed's WarmupDecayLR: warmup_min_lr (0) for the first step, then iteration i = step - 2:
    # log warm-up over warmup_num_steps = 2, linear decay to 0 at total_num_steps = 6 (the
    # Trainer's 2 epochs of 3 steps).
    gammas = [math.log(i + 1) / math.log(2) if i < 2 else (6 - i) / (6 - 2) for i in range(5)]
    assert got["lrs"] == pytest.approx([0.0] + [LR * g for g in gammas], rel=1e-12, abs=1e-15)


def test_a_config_value_that_disagrees_with_the_arguments_is_an_error_naming_both(tmp_path):
    import zeroshard.hf
    from hf_runs import Tokens, training_args, zero_config

    config = zero_config(3, gradient_clipping=1.0, train_micro_batch_size_per_gpu=8)
    with pytest.raises(ValueError) as error:
        zeroshard.hf.Trainer(model=tiny_llama(), args=training_args(str(tmp_path), 1), train_dataset=Tokens(),
                             zero_config=config)
    assert "gradient_clipping=1.0 in the zero_config, but TrainingArguments max_grad_norm=0.3" in str(error.value)
    assert "train_micro_batch_size_per_gpu=8 in the zero_config, but TrainingArguments " \
           "per_device_train_batch_size=2" in str(error.value)


def test_train_runs_once_per_trainer(runs):
    """The engine's schedule is built for one train(): a second one is an error, not a run on the
    first one's schedule."""
    got = runs.result(2, "auto_template")[0]
    assert got["train_again"] is not None and "train() was called a second time" in got["train_again"]


@pytest.mark.parametrize("arguments, says", [
    ({"save_only_model": True, "load_best_model_at_end": True, "eval_strategy": "steps", "save_strategy": "steps"},
     "save_only_model=True with load_best_model_at_end=True"),
    ({"torch_compile": True}, "torch_compile=True is not supported yet"),
    ({"bf16_full_eval": True}, "bf16_full_eval=True is not supported")])
def test_arguments_the_engine_cannot_honour_are_refused_when_the_trainer_is_built(tmp_path, arguments, says):
    import zeroshard.hf
    from hf_runs import Tokens, training_args, zero_config

    with pytest.raises(ValueError, match=says):
        zeroshard.hf.Trainer(model=tiny_llama(), args=training_args(str(tmp_path), 1, **arguments),
                             train_dataset=Tokens(), eval_dataset=Tokens(4), zero_config=zero_config(3))


def test_from_pretrained_refuses_adapters_that_start_from_the_base_weights(pretrained):
    """DoRA's magnitude (the base weight's norms) cannot be computed on the meta device."""
    import peft
    import transformers

    import zeroshard.hf
    from zeroshard.hf.pretrained import pending_load

    model = zeroshard.hf.from_pretrained(transformers.AutoModelForCausalLM, pretrained)
    dora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ValueError, match="lora_magnitude_vector"):
        pending_load(dora)
    plain = peft.get_peft_model(zeroshard.hf.from_pretrained(transformers.AutoModelForCausalLM, pretrained),
                                peft.LoraConfig(r=4, target_modules=["q_proj"]))
    assert pending_load(plain) is not None
