"""What the Hugging Face Trainer tests (test_hf_trainer.py) run on the spawned ranks.

The model is a tiny transformers LlamaForCausalLM built from a LlamaConfig (nothing is
downloaded), the data fixed token sequences with labels. N_SAMPLES = 20 sequences in micro
batches of 2 make 10 micro-batches an epoch: at 2 ranks with 2 accumulation steps the windows are
2, 2 and a short 1 (the Trainer's last window of an epoch), so every run crosses one.
"""

import os
import warnings

import torch

VOCAB, SEQ, N_SAMPLES, MICRO = 96, 12, 20, 2
LR, WEIGHT_DECAY, MAX_GRAD_NORM = 5e-3, 0.05, 0.3


def tiny_llama(seed=0):
    import transformers

    warnings.filterwarnings("ignore", category=FutureWarning)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                      max_position_embeddings=64)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=N_SAMPLES, seed=7):
        self.ids = torch.randint(1, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def training_args(out_dir, world_size, gas=2, **overrides):
    import transformers

    kwargs = dict(output_dir=out_dir, per_device_train_batch_size=MICRO, per_device_eval_batch_size=MICRO,
                  gradient_accumulation_steps=gas, learning_rate=LR, weight_decay=WEIGHT_DECAY,
                  max_grad_norm=MAX_GRAD_NORM, num_train_epochs=2, warmup_steps=2, lr_scheduler_type="linear",
                  logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=True,
                  dataloader_num_workers=0, disable_tqdm=True, optim="adamw_torch")
    kwargs.update(overrides)
    return transformers.TrainingArguments(**kwargs)


def zero_config(stage, **extra):
    config = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 40,
                                    "stage3_gather_16bit_weights_on_model_save": True},
              "zeroshard": {"collective_timeout_seconds": 30}}
    config.update(extra)
    return config


def logged(trainer):
    """(step, loss, grad_norm, learning_rate) of each training log line."""
    return [(e["step"], e["loss"], e.get("grad_norm"), e["learning_rate"])
            for e in trainer.state.log_history if "loss" in e]


def final_weights(trainer):
    """The trained model's full state dict in fp32 on CPU (every rank takes part)."""
    from zeroshard.hf import ShardedTrainer

    if isinstance(trainer, ShardedTrainer):
        state = trainer.engine.full_state_dict()
    else:
        state = trainer.accelerator.unwrap_model(trainer.model).state_dict()
    return {k: v.detach().float().cpu().clone() for k, v in state.items()}


def make_trainer(system, out_dir, world_size, stage=None, model=None, config=None, **arg_overrides):
    import transformers

    args = training_args(out_dir, world_size, **arg_overrides)
    model = model if model is not None else tiny_llama()
    if system == "ddp":
        return transformers.Trainer(model=model, args=args, train_dataset=Tokens(), eval_dataset=Tokens(8, seed=9))
    import zeroshard.hf

    return zeroshard.hf.Trainer(model=model, args=args, train_dataset=Tokens(), eval_dataset=Tokens(8, seed=9),
                                zero_config=config if config is not None else zero_config(stage))


def train_case(rank, world_size, out_dir, system, stage):
    """evaluate, a run of 2 epochs (6 optimizer steps, one short window per epoch), evaluate,
    predict and, for zeroshard, greedy generation against a whole copy of the trained model."""
    if system == "ddp":
        # Evaluated by a Trainer of its own: the plain Trainer (transformers 5.24) evaluated before
        # train() then trains without DDP (model_wrapped stays the bare model, no gradient averaging).
        before = make_trainer(system, out_dir, world_size).evaluate()["eval_loss"]
        trainer = make_trainer(system, out_dir, world_size, stage)
    else:
        trainer = make_trainer(system, out_dir, world_size, stage)
        before = trainer.evaluate()["eval_loss"]  # the engine is built here, and trains on in train()
    trainer.train()
    predictions = trainer.predict(Tokens(4, seed=11)).predictions
    predictions = predictions[0] if isinstance(predictions, tuple) else predictions
    out = {"logs": logged(trainer), "weights": final_weights(trainer), "eval_loss": trainer.evaluate()["eval_loss"],
           "eval_before": before, "predictions": torch.as_tensor(predictions)}
    if system != "ddp":
        prompt = Tokens(2, seed=13).ids[:, :4]
        model = trainer.model
        model.eval()
        with torch.no_grad():
            out["generated"] = model.generate(prompt, max_new_tokens=6, do_sample=False)
        whole = tiny_llama()
        whole.load_state_dict(out["weights"])
        whole.eval()
        with torch.no_grad():
            out["generated_whole"] = whole.generate(prompt, max_new_tokens=6, do_sample=False)
    return out


def checkpoint_case(rank, world_size, out_dir, stage, resume_from=None, gas=2):
    """save_steps=2 with save_total_limit=2 over 6 steps; or, with resume_from, a resumed run."""
    trainer = make_trainer("zeroshard", out_dir, world_size, stage, gas=gas, save_strategy="steps", save_steps=2,
                           save_total_limit=2)
    trainer.train(resume_from_checkpoint=resume_from)
    out = {"logs": logged(trainer), "weights": final_weights(trainer)}
    if rank == 0:
        out["folders"] = sorted(os.listdir(out_dir))
        last = os.path.join(out_dir, "checkpoint-6")
        out["checkpoint_files"] = sorted(os.listdir(last)) if os.path.isdir(last) else []
    return out


def save_model_case(rank, world_size, out_dir, stage, gather):
    """save_model() after one step: a from_pretrained-ready folder, or (stage 3 without
    stage3_gather_16bit_weights_on_model_save) the sharded checkpoint."""
    config = zero_config(stage)
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = gather
    trainer = make_trainer("zeroshard", out_dir, world_size, stage, config=config, max_steps=1)
    trainer.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.save_model()
    return {"weights": final_weights(trainer), "files": sorted(os.listdir(out_dir)) if rank == 0 else None,
            "warnings": [str(w.message) for w in caught]}


def tokenizer():
    """A word-level tokenizer over t0..t95 (t0 pad, t1 unk, t2 eos), made here: nothing is downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t2", unk_token="t1")


def sft_dataset(n=N_SAMPLES, seed=7):
    import datasets

    ids = torch.randint(3, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))
    return datasets.Dataset.from_dict({"input_ids": ids.tolist()})


def lora_config():
    import peft

    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                           task_type="CAUSAL_LM")


def sft_case(rank, world_size, out_dir, system, stage, model_dir=None):
    """TRL's SFTTrainer with a peft LoRA for 1 epoch (3 steps); zeroshard also saves the adapter.
    model_dir: the base from zeroshard.hf.from_pretrained (meta device) instead of built here."""
    import trl

    import zeroshard.hf

    args = trl.SFTConfig(output_dir=out_dir, per_device_train_batch_size=MICRO, gradient_accumulation_steps=2,
                         learning_rate=LR, weight_decay=WEIGHT_DECAY, max_grad_norm=MAX_GRAD_NORM, num_train_epochs=1,
                         logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                         optim="adamw_torch", dataloader_num_workers=0,
                         bf16=False)  # SFTConfig's default is bf16, autocast for the plain SFTTrainer
    if model_dir is not None:
        import transformers

        model = zeroshard.hf.from_pretrained(transformers.AutoModelForCausalLM, model_dir)
    else:
        model = tiny_llama()
    trainer_class = trl.SFTTrainer if system == "ddp" else zeroshard.hf.wrap(trl.SFTTrainer)
    extra = {} if system == "ddp" else {"zero_config": zero_config(stage)}
    torch.manual_seed(1)  # the adapters' initial values
    trainer = trainer_class(model=model, args=args, train_dataset=sft_dataset(), processing_class=tokenizer(),
                            peft_config=lora_config(), **extra)
    initial = final_weights(trainer) if model_dir is not None else None  # builds the engine before train()
    trainer.train()
    out = {"logs": logged(trainer), "weights": {k: v for k, v in final_weights(trainer).items() if "lora_" in k},
           "frozen_bytes": None, "initial": initial}
    if system != "ddp":
        out["frozen_bytes"] = trainer.engine.memory_stats()["frozen"]
        trainer.save_model()
        out["files"] = sorted(os.listdir(out_dir)) if rank == 0 else None
        probe = sft_dataset(2, seed=21)["input_ids"]
        trainer.model.eval()
        with torch.no_grad():
            out["logits"] = trainer.model(input_ids=torch.tensor(probe)).logits
    return out


def pretrained_case(rank, world_size, out_dir, model_dir, stage):
    """train_case's run on zeroshard.hf.from_pretrained(AutoModelForCausalLM, model_dir): the model
    is built on the meta device and the engine reads each rank's slices of model_dir."""
    import transformers

    import zeroshard.hf

    model = zeroshard.hf.from_pretrained(transformers.AutoModelForCausalLM, model_dir)
    on_meta = all(p.is_meta for p in model.parameters())
    trainer = make_trainer("zeroshard", out_dir, world_size, stage, model=model)
    trainer.train()
    return {"on_meta": on_meta, "logs": logged(trainer), "weights": final_weights(trainer),
            "read": trainer.engine.last_load_stats()["param_bytes_read"]}


# Hugging Face's DeepSpeed template: every Trainer-owned value "auto".
AUTO_TEMPLATE = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"},
    "zeroshard": {"collective_timeout_seconds": 30},
}


def auto_case(rank, world_size, out_dir):
    """The template's values as the engine took them, and the learning rates of a 6-step run."""
    trainer = make_trainer("zeroshard", out_dir, world_size, config=AUTO_TEMPLATE)
    trainer.train()
    lrs = [lr for _, _, _, lr in logged(trainer)]  # a second train() starts a new log
    try:
        trainer.train()
        again = None
    except RuntimeError as e:
        again = str(e)
    engine = trainer.engine
    group = engine.optimizer.param_groups[0]
    zero = engine.config.zero_optimization
    return {"train_again": again, "buckets": (zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size,
                                              zero.stage3_param_persistence_threshold),
            "train_batch_size": engine.train_batch_size, "micro": engine.train_micro_batch_size_per_gpu,
            "accumulation": engine.gradient_accumulation_steps, "clipping": engine.config.gradient_clipping,
            "betas": tuple(group["betas"]), "eps": group["eps"], "weight_decay": group["weight_decay"],
            "schedule": engine.lr_scheduler.type, "lrs": lrs}
