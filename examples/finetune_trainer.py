"""Fine-tune with the Hugging Face Trainer or TRL's SFTTrainer on zeroshard: one changed line.

    torchrun --nproc-per-node 2 examples/finetune_trainer.py --work /tmp/finetune_trainer
    torchrun --nproc-per-node 2 examples/finetune_trainer.py --work /tmp/finetune_trainer --no-trl

Default: TRL's SFTTrainer with a peft LoRA (q_proj, v_proj) at ZeRO-3, the frozen base sharded
too. --no-trl: the plain transformers Trainer fine-tuning every weight. --model <folder>: a Hugging
Face model folder (model.safetensors[.index.json], config.json, tokenizer files), built on the
meta device by zeroshard.hf.from_pretrained and read by each rank in slices; without it, nothing
can be downloaded here, so rank 0 first writes a small Llama and a word-level tokenizer of its
own into <work>/pretrained. --text <file>: one training text per line (default: synthetic).

The run ends with trainer.save_model(): the adapter (adapter_model.safetensors and
adapter_config.json) or, with --no-trl, a from_pretrained-ready folder, in <work>/final.
Gloo on CPU; with GPUs, NCCL and one rank per GPU.
"""

import argparse
import os
import random

import torch
import torch.distributed as dist


def write_small_model(folder):
    """A 4-layer Llama and a word-level tokenizer over w0..w255, saved as a model folder."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w3"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="w0", bos_token="w1",
                                                     eos_token="w2", unk_token="w3")
    tokenizer.save_pretrained(folder)


def texts(path, n=64):
    if path:
        with open(path) as f:
            return [line.strip() for line in f if line.strip()]
    rng = random.Random(0)  # counting patterns a small model can learn
    return [" ".join(f"w{(start + i * step) % 250 + 4}" for i in range(24))
            for start, step in ((rng.randrange(250), rng.randrange(1, 5)) for _ in range(n))]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="/tmp/finetune_trainer")
    parser.add_argument("--model", help="a Hugging Face model folder (default: write a small one)")
    parser.add_argument("--text", help="a text file, one training example per line")
    parser.add_argument("--no-trl", action="store_true", help="the plain Trainer, every weight trained")
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=8)
    opts = parser.parse_args()

    import datasets
    import transformers

    import zeroshard.hf

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    model_dir = opts.model or os.path.join(opts.work, "pretrained")
    if opts.model is None and dist.get_rank() == 0 and not os.path.isdir(model_dir):
        write_small_model(model_dir)
    dist.barrier()

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    train = datasets.Dataset.from_dict({"text": texts(opts.text)})
    # The config keeps the sharding; batch sizes, clipping, AdamW and the schedule come from the
    # TrainingArguments ("auto" or absent here).
    zero_config = {"zero_optimization": {"stage": opts.stage, "stage3_gather_16bit_weights_on_model_save": True}}
    common = dict(output_dir=os.path.join(opts.work, "run"), per_device_train_batch_size=4,
                  gradient_accumulation_steps=2, learning_rate=2e-3, max_steps=opts.max_steps, warmup_steps=2,
                  logging_steps=1, save_steps=4, save_total_limit=1, report_to=[], seed=0,
                  use_cpu=not torch.cuda.is_available(), optim="adamw_torch")

    # --- the example's code (README "Hugging Face Trainer and TRL") ---
    model = zeroshard.hf.from_pretrained(transformers.AutoModelForCausalLM, model_dir)
    if opts.no_trl:
        train = train.map(lambda row: tokenizer(row["text"]), remove_columns=["text"])
        trainer = zeroshard.hf.Trainer(  # was: transformers.Trainer(
            model=model, args=transformers.TrainingArguments(**common), train_dataset=train,
            data_collator=transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False),
            zero_config=zero_config)
    else:
        import peft
        import trl

        SFTTrainer = zeroshard.hf.wrap(trl.SFTTrainer)  # was: from trl import SFTTrainer
        trainer = SFTTrainer(
            model=model, args=trl.SFTConfig(**common), train_dataset=train, processing_class=tokenizer,
            peft_config=peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                        task_type="CAUSAL_LM"),
            zero_config=zero_config)
    trainer.train()
    trainer.save_model(os.path.join(opts.work, "final"))
    # --- end ---

    if dist.get_rank() == 0:
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        precision = "bf16" if trainer.engine.config.bf16_enabled else "fp32"
        print(f"finetune_trainer: {'Trainer' if opts.no_trl else 'SFTTrainer + LoRA'} at stage {opts.stage} on "
              f"{dist.get_world_size()} ranks, {precision}: loss {losses[0]:.4f} -> {losses[-1]:.4f} over "
              f"{len(losses)} steps; "
              f"saved {sorted(os.listdir(os.path.join(opts.work, 'final')))}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
