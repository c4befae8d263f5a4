"""Train a small GPT-style character model with zeroshard.

    torchrun --nproc-per-node 2 examples/train_gpt.py --config configs/zero3.json

With --save-dir and --resume auto a job that torchrun restarts (--max-restarts) goes on from its
last complete checkpoint, with the losses and weights of a run that was never interrupted:

    torchrun --max-restarts 3 --nproc-per-node 2 examples/train_gpt.py --save-dir ckpt --save-every 50 --resume auto

The corpus is the license texts every Debian machine has under /usr/share/common-licenses.
Gloo on CPU; with GPUs, NCCL and one rank per GPU. Only rank 0 logs: the loss, tokens per
second, and the model-state memory each rank holds next to what DDP would hold (16 bytes per
parameter in fp32: weights, gradients, exp_avg, exp_avg_sq).
"""

import argparse
import json
import math
import os
import resource
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zeroshard

CORPUS = Path("/usr/share/common-licenses")


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, seq, dim=128, heads=4, layers=4):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def load_corpus():
    files = sorted(p for p in CORPUS.iterdir() if p.is_file())
    if not files:
        raise SystemExit(f"no text found under {CORPUS}")
    text = "\n".join(p.read_text(errors="replace") for p in files)
    index = {c: i for i, c in enumerate(sorted(set(text)))}
    return torch.tensor([index[c] for c in text], dtype=torch.long), len(index)


def write_summary(path, engine, losses):
    """Rank 0 writes what a run can be compared by (json keeps each float exactly); the ranks'
    launch variables say where torchrun put them: which node (GROUP_RANK) and how many per node."""
    comm = engine.comm_stats()
    launch = {key: os.environ.get(key) for key in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")}
    launch["comm_levels"] = sorted(level for level in ("intra", "inter") if level in comm)
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, launch)
    if dist.get_rank() == 0:
        summary = {"losses": {str(step): loss for step, loss in losses.items()}, "plan": engine.plan(), "ranks": ranks}
        Path(path).write_text(json.dumps(summary, indent=1))


def fault_injection(args, rank):
    """Test-only (tests/python/test_restart.py): on torchrun's first attempt, rank 1 dies at a chosen
    point with no time involved: killed (SIGKILL) in step --test-kill-at-step after its forward,
    or inside the save of step --test-kill-in-save, by the first write of its shard file. Returns
    (die_now(step), before_save(step))."""
    armed = rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    def die_now(step):
        if armed and step == args.test_kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)

    def before_save(step):
        if armed and step == args.test_kill_in_save:
            # Python ignores SIGXFSZ; with its default action back and a file size limit of 0, the
            # kernel kills this rank at its first write of a file: rank 0 has made the staging
            # directory (the save's first phase) and waits for this rank's shard file.
            signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    return die_now, before_save


def resume_point(args, rank):
    """Whether to load `latest` from --save-dir: rank 0 looks and every rank follows (a load is
    collective). A save that a dead rank left unfinished is a .staging- directory: never a
    checkpoint (docs/checkpoints.md, Crash safety); it is named, and the next save removes it."""
    decision = [None]
    if rank == 0:
        save_dir = Path(args.save_dir)
        found = (save_dir / "latest").exists()
        unfinished = sorted(p.name for p in save_dir.glob(".staging-*") if p.is_dir())
        if unfinished:
            print(f"unfinished save(s) in {save_dir}, not checkpoints: {', '.join(unfinished)}", flush=True)
        if args.resume == "latest" and not found:
            print(f"--resume: no checkpoint in {save_dir} (no 'latest'); --resume auto starts fresh instead",
                  flush=True)
        elif not found:
            print(f"--resume auto: no checkpoint in {save_dir} yet, starting fresh", flush=True)
        decision = [args.resume == "latest" or found]
    dist.broadcast_object_list(decision, src=0)
    return decision[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/zero3.json")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--save-dir", default=None,
                        help="save a sharded checkpoint here every --save-every steps and after the last")
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--save-every-minutes", type=float, default=0,
                        help="also save into --save-dir at the first step this many minutes after the last save "
                             "(zeroshard.checkpoint.every_minutes; rank 0's clock decides): 30-60 on rented "
                             "machines, with zeroshard.checkpoint.keep_last 2")
    parser.add_argument("--resume", nargs="?", const="latest", choices=("latest", "auto"), default=None,
                        help="continue from the checkpoint 'latest' names in --save-dir, with its step and data "
                             "position: bare --resume (or --resume latest) needs one there; --resume auto starts "
                             "fresh when there is none, for a job torchrun may restart (--max-restarts), which "
                             "then goes on from the last complete checkpoint")
    parser.add_argument("--test-kill-at-step", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--test-kill-in-save", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--summary", default=None,
                        help="write a JSON file at the end: the logged losses in full precision, the plan, and "
                             "each rank's launch (RANK, LOCAL_WORLD_SIZE, GROUP_RANK) and comm_stats() levels")
    args = parser.parse_args()
    if args.resume and not args.save_dir:
        parser.error("--resume needs --save-dir")
    if args.save_every_minutes and not args.save_dir:
        parser.error("--save-every-minutes needs --save-dir")

    config = zeroshard.Config.from_file(args.config)
    if args.save_every_minutes:
        settings = config.to_dict()
        settings["zeroshard"]["checkpoint"].update(every_minutes=args.save_every_minutes, dir=args.save_dir)
        config = zeroshard.Config.from_dict(settings)
    zeroshard.init_distributed(config.zeroshard.collective_timeout_seconds)
    rank, world = dist.get_rank(), dist.get_world_size()
    # One rank per GPU when there are enough GPUs for every rank; the CPU otherwise.
    on_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if on_gpu else torch.device("cpu")

    data, vocab = load_corpus()
    torch.manual_seed(0)
    model = GPT(vocab, args.seq).to(device)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    engine = zeroshard.initialize(model, config, param_groups=[
        {"params": decay}, {"params": no_decay, "weight_decay": 0.0}])
    micro, gas = engine.train_micro_batch_size_per_gpu, engine.gradient_accumulation_steps
    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"zeroshard stage {engine.stage}: {world} ranks on {device.type}, {n_params / 1e6:.2f}M parameters, "
              f"{data.numel()} characters, global batch {engine.train_batch_size} x {args.seq}", flush=True)
        print("plan:\n  " + engine.plan().replace("\n", "\n  "), flush=True)

    generator = torch.Generator().manual_seed(1234)
    first_step = 1
    if args.resume and resume_point(args, rank):
        # Any world size and stage: each rank reads only its own slices of the saved shards.
        path, client_state = engine.load_checkpoint(args.save_dir)
        first_step = client_state["step"] + 1
        generator.set_state(client_state["batches"])  # the same batches an uninterrupted run would see
        if rank == 0:
            print(f"resumed from {path} at step {first_step}", flush=True)
    start, tokens, first_loss, logged = time.perf_counter(), 0, None, {}
    step = first_step
    # A save on the clock happens inside engine.step(), at the end of `step`: the same client
    # state as the saves below, so --resume goes on from either.
    engine.clock_client_state = lambda: {"step": step, "batches": generator.get_state()}
    die_now, before_save = fault_injection(args, rank)
    for step in range(first_step, args.steps + 1):
        window = torch.zeros((), device=device)
        for _ in range(gas):
            # Every rank draws the same global batch and takes its own rows.
            offsets = torch.randint(0, data.numel() - args.seq - 1, (micro * world,), generator=generator)
            mine = offsets[rank * micro:(rank + 1) * micro]
            batch = torch.stack([data[o:o + args.seq + 1] for o in mine.tolist()]).to(device)
            logits = engine(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1))
            die_now(step)
            engine.backward(loss)
            engine.step()
            window += loss.detach() / gas
            tokens += batch[:, 1:].numel() * world
        if args.save_dir and (step == args.steps or (args.save_every and step % args.save_every == 0)):
            before_save(step)
            engine.save_checkpoint(args.save_dir, client_state={"step": step, "batches": generator.get_state()})
        if step % args.log_every == 0 or step == first_step or step == args.steps:
            dist.all_reduce(window)
            mean = window.item() / world
            first_loss = mean if first_loss is None else first_loss
            logged[step] = mean
            if rank == 0:
                rate = tokens / (time.perf_counter() - start)
                print(f"step {step:5d}  loss {mean:.4f}  ({math.exp(mean):.1f} ppl)  {rate:,.0f} tokens/s", flush=True)
    mem = engine.memory_stats()
    if args.summary:
        write_summary(args.summary, engine, logged)
    if rank == 0:
        ddp = 16 * n_params
        print(f"model state per rank: {mem['total'] / 2**20:.2f} MiB (params {mem['params'] / 2**20:.2f}, "
              f"grads {mem['grads'] / 2**20:.2f}, optimizer {mem['optimizer'] / 2**20:.2f}); "
              f"DDP would hold {ddp / 2**20:.2f} MiB ({mem['total'] / ddp:.2f}x)")
        if logged:
            print(f"final loss {mean:.4f} (first {first_loss:.4f})", flush=True)
        else:  # resumed from the last step's checkpoint (a restart after the final save)
            print(f"nothing left to train: the checkpoint is at step {first_step - 1} of {args.steps}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
