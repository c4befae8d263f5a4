"""A training script written the way a DeepSpeed user writes one, with the one changed import.

    torchrun --nproc-per-node 2 tests/python/ds_script.py --deepspeed_config ds_config.json \
        --steps 6 --out record.pt

With DS_SCRIPT_BACKEND=deepspeed it imports DeepSpeed itself instead (benchmarks/
deepspeed_parity.py runs both). Rank 0 saves what the run did to --out: per micro-step the
loss (mean over ranks), the learning rate the step used, the accumulation boundary and
global_steps, per optimizer step its wall time, and the final weights (gathered with
deepspeed.zero.GatheredParameters, as a stage-3 script does). The tests call main(argv) on
ranks that already share a process group.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

if os.environ.get("DS_SCRIPT_BACKEND") == "deepspeed":
    import deepspeed
else:
    import zeroshard.deepspeed as deepspeed

from models import TinyTransformer

SEQ, VOCAB = 9, 37


class LanguageModel(TinyTransformer):
    """The tiny transformer whose forward returns the next-token loss, as DeepSpeed examples' models do."""

    def forward(self, tokens):
        logits = super().forward(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, self.vocab), tokens[:, 1:].reshape(-1))


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, size, seed=1):
        self.tokens = torch.randint(0, VOCAB, (size, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        return self.tokens[index]


def parse(argv=None):
    parser = argparse.ArgumentParser(description="tiny DeepSpeed training script")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the DeepSpeed launcher")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps (one pass over the data)")
    parser.add_argument("--out", default=None, help="where rank 0 saves the record (torch.save)")
    parser.add_argument("--save_dir", default=None, help="save a checkpoint and the 16-bit model here at the end")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = LanguageModel()
    with open(args.deepspeed_config) as f:
        dataset = TokenDataset(args.steps * json.load(f)["train_batch_size"])
    engine, optimizer, loader, scheduler = deepspeed.initialize(args=args, model=model,
                                                              model_parameters=model.parameters(),
                                                              training_data=dataset)
    record = {"loss": [], "lr": [], "boundary": [], "global_steps": [], "step_time": []}
    started = time.perf_counter()
    for tokens in loader:
        lr = engine.get_lr()[0]
        loss = engine(tokens)
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        record["loss"].append(mean.item() / dist.get_world_size())
        record["lr"].append(lr)
        record["boundary"].append(boundary)
        record["global_steps"].append(engine.global_steps)
        if boundary:
            now = time.perf_counter()
            record["step_time"].append(now - started)
            started = now
    if args.save_dir:
        engine.save_checkpoint(args.save_dir, client_state={"epoch": 1})
        engine.save_16bit_model(args.save_dir)
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        weights = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    record["weights"] = weights
    record["global_samples"] = engine.global_samples
    if dist.get_rank() == 0 and args.out:
        torch.save(record, args.out)
    return record


if __name__ == "__main__":
    main()
