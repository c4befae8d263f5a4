"""Fine-tune a Hugging Face causal LM with ZeRO-3, never building it whole on any rank.

    torchrun --nproc-per-node 2 examples/finetune_hf.py --work /tmp/finetune_hf

Nothing can be downloaded here, so the example first writes its own "pretrained" model: rank 0
builds a small Llama (or --arch gpt2 / gpt_neox) from a config and saves it with
save_pretrained, in shards with an index (model.safetensors.index.json) as large checkpoints
on the Hub are. Then every rank:

1. builds the model from its config on the meta device (no memory, no initialisation work);
2. zeroshard.initialize allocates only this rank's ZeRO-3 shards (the units are the model's
   decoder layers, found without configuration) and engine.load_pretrained reads only this
   rank's slices of the shards, converting dtype on the fly;
3. checks the loaded model's logits against the checkpoint loaded by from_pretrained;
4. fine-tunes a few steps on synthetic token data;
5. saves with save_16bit_model (model.safetensors with the model's own names) plus the config,
   and rank 0 reloads that directory with from_pretrained and compares logits with the engine's.

Gloo on CPU; with GPUs, NCCL and one rank per GPU.
"""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

import zeroshard

ARCHS = {
    # Small shapes that still have every part of the real models (GQA, rotary, tied embeddings).
    "llama": ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
                                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)),
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=4, n_head=4, vocab_size=256, n_positions=128, bos_token_id=1,
                                eos_token_id=2)),
    "gpt_neox": ("GPTNeoXConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                       num_attention_heads=4, vocab_size=256, max_position_embeddings=128,
                                       bos_token_id=1, eos_token_id=2)),
}


def write_pretrained(arch, directory, shard_size):
    import transformers

    name, kwargs = ARCHS[arch]
    config = getattr(transformers, name)(**kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory, max_shard_size=shard_size)


def hf_logits(directory, tokens, dtype):
    """Logits of the model in `directory` as from_pretrained loads it, in `dtype`."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=sorted(ARCHS), default="llama")
    parser.add_argument("--work", default="/tmp/finetune_hf", help="where the pretrained and fine-tuned models go")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--shard-size", default="100KB", help="save_pretrained's max_shard_size for the pretrained model")
    parser.add_argument("--bf16", action="store_true", help="bf16 compute (fp32 master weights)")
    args = parser.parse_args()

    import transformers

    zeroshard.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    work = Path(args.work)
    pretrained, finetuned = work / "pretrained", work / "finetuned"
    if rank == 0:
        write_pretrained(args.arch, pretrained, args.shard_size)
    dist.barrier()

    config = transformers.AutoConfig.from_pretrained(pretrained)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True,
                              "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": args.bf16},
    }
    engine = zeroshard.initialize(model, ds_config)
    loaded = engine.load_pretrained(pretrained)
    units = [u["name"] for u in engine.stage3_units()]
    if rank == 0:
        print(f"finetune_hf: {args.arch} on {world} ranks, units {units[0]} .. {units[-1]} ({len(units)}), "
              f"{sum(p.numel() for p in model.parameters())} parameters; this rank holds "
              f"{engine.memory_stats()['total']} bytes of model state")
        print(f"finetune_hf: loaded {pretrained} (missing {loaded.missing_keys}, unexpected {loaded.unexpected_keys})")

    probe = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    model.eval()
    with torch.no_grad():
        loaded_logits = engine(input_ids=probe).logits.float()
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    if rank == 0:
        loaded_equal = torch.equal(loaded_logits, hf_logits(pretrained, probe, dtype))
        print(f"finetune_hf: logits after load_pretrained equal from_pretrained's: {loaded_equal}")
    model.train()

    generator = torch.Generator().manual_seed(100 + rank)
    for step in range(args.steps):
        # Synthetic data with structure to learn: each sequence counts up from a random start.
        start = torch.randint(0, config.vocab_size, (2, 1), generator=generator)
        tokens = (start + torch.arange(32)) % config.vocab_size
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"finetune_hf: step {step} loss {loss.item():.4f}")

    engine.save_16bit_model(finetuned)
    model.eval()
    with torch.no_grad():
        trained_logits = engine(input_ids=probe).logits.float()
    if rank == 0:
        config.save_pretrained(finetuned)
        theirs = hf_logits(finetuned, probe, dtype)
        same = torch.equal(trained_logits, theirs)
        print(f"finetune_hf: saved {finetuned}; from_pretrained gives the engine's logits: {same}")
        result = {"loaded_equal": loaded_equal, "reloaded_equal": same,
                  "max_diff": float((trained_logits - theirs).abs().max()), "units": units,
                  "missing": loaded.missing_keys, "unexpected": loaded.unexpected_keys}
        (work / "result.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
