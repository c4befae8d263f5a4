"""Step time and per-rank model-state memory of zeroshard stages 0-3 against DDP + AdamW,
DDP + ZeroRedundancyOptimizer(AdamW) and FSDP2 (fully_shard) + AdamW, on one small GPT, 2 Gloo
ranks on CPU.

    python benchmarks/bench_stages.py                      # spawns 2 ranks per config
    python benchmarks/bench_stages.py --quick              # smoke run, about a minute
    torchrun --nproc-per-node 2 benchmarks/bench_stages.py # all configs in one process pair

See benchmarks/README.md for what is measured and how to read the ratios.
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "python"))

from gpt import make_model, next_token_loss, token_batch  # noqa: E402
from stage_report import MB, check, loss_reference, render, render_losses, render_memory, summarize  # noqa: E402

CONFIGS = ("zeroshard-stage0", "zeroshard-stage1", "zeroshard-stage2", "zeroshard-stage3", "ddp",
           "ddp+zero-redundancy", "fsdp2")


def _rss_bytes():
    # ru_maxrss is in KiB on Linux: the peak resident set of this process so far.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _local(t):
    # A DTensor's nbytes is the global tensor's; this rank holds only its local shard.
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(tensors):
    return sum(_local(t).nbytes for t in tensors if t is not None)


def _optimizer_state_bytes(state):
    return sum(_local(v).nbytes for s in state.values() for v in s.values() if torch.is_tensor(v))


def _adamw_kwargs(s):
    return dict(lr=s["lr"], weight_decay=s["weight_decay"], betas=(0.9, 0.999), eps=1e-8)


def _torch_adamw(params, s):
    kwargs = _adamw_kwargs(s)
    if s["fused"]:
        kwargs["fused"] = True
    return torch.optim.AdamW(params, **kwargs)


def _torch_adamw_name(s):
    return "torch.optim.AdamW" + ("(fused=True)" if s["fused"] else "")


def _fused_adamw_works():
    try:
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], fused=True)
        return True
    except (RuntimeError, ValueError):
        return False


def _ddp_bucket_bytes(ddp):
    """Bytes of DDP's gradient buckets: separate from .grad unless gradient_as_bucket_view."""
    data = ddp._get_ddp_logging_data()  # private, but the only place DDP reports its buckets
    sizes = data.get("bucket_sizes")
    if not sizes or data.get("gradient_as_bucket_view"):
        return 0 if sizes else None
    return sum(int(s) for s in str(sizes).split(",") if s.strip())


class ZeroshardStep:
    def __init__(self, model, stage, s):
        import zeroshard

        config = {
            "train_micro_batch_size_per_gpu": s["batch"],
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {**_adamw_kwargs(s), "betas": [0.9, 0.999]}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": s["bucket_elems"]},
        }
        if stage == 3:
            # Default prefetch and reshard_after_forward; units named by class rather than found
            # as the largest nn.ModuleList, so they are the blocks fsdp2 shards whatever gpt.py's
            # layout. Below the threshold only biases and LayerNorms stay gathered.
            config["zero_optimization"]["stage3_param_persistence_threshold"] = s["persistence_threshold"]
            config["zeroshard"] = {"stage3_unit_classes": ["Block"]}
        self.engine = zeroshard.initialize(model, config)
        self.optimizer_name = "zeroshard sharded AdamW (at::_fused_adamw_)"

    def __call__(self, tokens):
        loss = next_token_loss(self.engine(tokens[:, :-1]), tokens)
        self.engine.backward(loss)
        self.engine.step()
        return loss

    def memory(self):
        m = self.engine.memory_stats()
        # gathered_peak: the most gathered full-parameter bytes alive at once during the last
        # step (stage 3 only; below it every parameter is always whole). Not part of the total.
        return dict(params=m["params"], grads=m["grads"], optimizer=m["optimizer"], comm_buffers=0,
                    total=m["total"], gathered_peak=m["gathered_peak"] if self.engine.stage == 3 else None)

    def extras(self):
        return {"comm_stats": self.engine.comm_stats(), "memory_stats": self.engine.memory_stats()}


class DDPStep:
    """DDP + torch.optim.AdamW, or DDP + ZeroRedundancyOptimizer(AdamW) (its documented use)."""

    def __init__(self, model, zero, s):
        from torch.nn.parallel import DistributedDataParallel

        self.model = model
        # Bucket capacity as close as DDP allows to zeroshard's reduce_bucket_size.
        self.ddp = DistributedDataParallel(model, bucket_cap_mb=s["bucket_elems"] * 4 / 2**20)
        if zero:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            kwargs = _adamw_kwargs(s)
            if s["fused"]:
                kwargs["fused"] = True
            self.optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **kwargs)
            self.local_state = self.optimizer.optim.state
            self.optimizer_name = f"ZeroRedundancyOptimizer({_torch_adamw_name(s)})"
        else:
            self.optimizer = _torch_adamw(model.parameters(), s)
            self.local_state = self.optimizer.state
            self.optimizer_name = _torch_adamw_name(s)

    def __call__(self, tokens):
        # Zeroing first leaves the last step's gradients alive at the end, where memory is read.
        self.optimizer.zero_grad(set_to_none=True)
        loss = next_token_loss(self.ddp(tokens[:, :-1]), tokens)
        loss.backward()
        self.optimizer.step()
        return loss

    def memory(self):
        params = list(self.model.parameters())
        buckets = _ddp_bucket_bytes(self.ddp)
        m = dict(params=_nbytes(params), grads=_nbytes(p.grad for p in params),
                 optimizer=_optimizer_state_bytes(self.local_state), comm_buffers=buckets)
        m["total"] = m["params"] + m["grads"] + m["optimizer"] + (buckets or 0)
        return m

    def extras(self):
        # Logging data keeps the construction-time buckets (one, until the first backward
        # rebuilds them); the reducer's own copies show the buckets actually in use.
        current = [b.buffer().nbytes for b in self.ddp.reducer._get_zeros_like_grad_buckets()]
        return {"ddp_bucket_bytes_at_construction": str(self.ddp._get_ddp_logging_data().get("bucket_sizes")),
                "ddp_bucket_bytes": current}


class FSDP2Step:
    """FSDP2's standard recipe: fully_shard on every block, then on the root (which takes the
    embeddings, final norm and head), reshard_after_forward=True; AdamW on the DTensor shards."""

    def __init__(self, model, s):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        # fused=True runs on CPU DTensor parameters (checked with torch 2.13: same losses as
        # foreach and the default), so fsdp2 uses whatever the DDP rows use.
        self.optimizer = _torch_adamw(model.parameters(), s)
        self.optimizer_name = _torch_adamw_name(s) + " on DTensor shards"

    def __call__(self, tokens):
        self.optimizer.zero_grad(set_to_none=True)
        loss = next_token_loss(self.model(tokens[:, :-1]), tokens)
        loss.backward()
        self.optimizer.step()
        return loss

    def memory(self):
        # Local shards only: after backward every unit is resharded, and .grad is the
        # reduce-scattered shard. FSDP2's all-gather and reduce-scatter buffers are transient.
        params = list(self.model.parameters())
        m = dict(params=_nbytes(params), grads=_nbytes(p.grad for p in params),
                 optimizer=_optimizer_state_bytes(self.optimizer.state), comm_buffers=0)
        m["total"] = m["params"] + m["grads"] + m["optimizer"]
        return m

    def extras(self):
        return {}


def _make_step(name, model, s):
    if name.startswith("zeroshard-stage"):
        return ZeroshardStep(model, int(name[-1]), s)
    if name == "fsdp2":
        return FSDP2Step(model, s)
    return DDPStep(model, zero=(name == "ddp+zero-redundancy"), s=s)


def run_config(rank, world_size, name, s):
    """Trains the benchmark model with config `name` on this rank; returns its raw numbers."""
    rss_before = _rss_bytes()
    model = make_model(s["seed"], **s["model"])
    vocab = s["model"]["vocab"]
    batches = [token_batch(s["seed"], i, rank, s["batch"], s["seq"], vocab) for i in range(s["warmup"] + s["steps"])]
    step = _make_step(name, model, s)

    times, cpu_times, losses = [], [], []
    load_before = os.getloadavg()
    for i, tokens in enumerate(batches):
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = step(tokens)
        elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
        if i >= s["warmup"]:
            times.append(elapsed)
            # CPU time of every thread of this rank (compute and Gloo): unlike wall time, it
            # hardly grows when other processes compete for the cores.
            cpu_times.append(elapsed_cpu)
        losses.append(loss.item())
    load_after = os.getloadavg()

    memory = step.memory()
    # The same held-out batch on every rank checks the final parameters, not only the last step.
    model.eval()
    with torch.no_grad():
        held_out = token_batch(s["seed"] + 1, 0, 0, s["batch"], s["seq"], vocab)
        eval_loss = next_token_loss(model(held_out[:, :-1]), held_out).item()
    peak_rss = _rss_bytes()  # before extras(), which may allocate
    return dict(rank=rank, config=name, optimizer=step.optimizer_name, step_seconds=times,
                step_cpu_seconds=cpu_times, losses=losses, load_average=(load_before[0], load_after[0]),
                eval_loss=eval_loss, memory=memory, rss_before_bytes=rss_before, peak_rss_bytes=peak_rss,
                threads=torch.get_num_threads(), extras=step.extras())


def _spawned_rank(rank, world_size, name, s):
    # spawn.run_ranks has already set one thread and joined the Gloo group.
    return run_config(rank, world_size, name, s)


# ---------------------------------------------------------------------------------------------
# Launch


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="timed steps per config (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    p.add_argument("--rounds", type=int, default=2,
                   help="run every config this many times, in alternating order (default 2)")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round of 2 warm-up + 5 timed steps")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step (default 8)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--bucket-elems", type=int, default=1_500_000,
                   help="zeroshard reduce_bucket_size, and DDP bucket_cap_mb of the same bytes")
    p.add_argument("--persistence-threshold", type=int, default=10_000,
                   help="zeroshard-stage3's stage3_param_persistence_threshold (default 1e4: every "
                        "weight matrix sharded, biases and LayerNorms kept gathered)")
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ", ".join(CONFIGS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one config may take")
    p.add_argument("--json", metavar="PATH", help="write the raw numbers here")
    args = p.parse_args()
    if args.quick:
        args.steps, args.warmup, args.rounds = 5, 2, 1
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        p.error(f"unknown configs {unknown}; choose from {', '.join(CONFIGS)}")
    args.configs = configs
    return args


def settings_of(args):
    return dict(steps=args.steps, warmup=args.warmup, batch=args.batch, seq=args.seq, seed=args.seed,
                bucket_elems=args.bucket_elems, persistence_threshold=args.persistence_threshold, lr=1e-3, weight_decay=0.01, fused=_fused_adamw_works(),
                model=dict(vocab=512, dim=256, heads=4, hidden=1024, layers=args.layers, max_seq=args.seq))


def _round_orders(args):
    # Alternating order (A B C, C B A, ...) spreads slow drifts of the machine over all configs.
    return [args.configs if r % 2 == 0 else args.configs[::-1] for r in range(args.rounds)]


def run_spawned(args, s):
    """One fresh group of processes per config and round, so each peak RSS belongs to one
    config."""
    from spawn import run_ranks

    rounds = {name: [] for name in args.configs}
    for r, order in enumerate(_round_orders(args)):
        for name in order:
            t0 = time.perf_counter()
            ranks = run_ranks(_spawned_rank, args.world_size, name, s, timeout=args.timeout)
            rounds[name].append(ranks)
            wall = statistics.median(max(x["step_seconds"][i] for x in ranks) for i in range(s["steps"]))
            print(f"  round {r + 1}/{args.rounds} {name}: {1000 * wall:.1f} ms/step, last loss "
                  f"{statistics.fmean(x['losses'][-1] for x in ranks):.4f}, load {ranks[0]['load_average'][1]:.1f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return {name: summarize(name, rounds[name], fresh_processes=True) for name in args.configs}


def run_torchrun(args, s):
    """Under torchrun the same processes run every config in turn: peak RSS is cumulative, so
    it is not reported per config."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rounds = {name: [] for name in args.configs}
    for r, order in enumerate(_round_orders(args)):
        for name in order:
            mine = run_config(dist.get_rank(), dist.get_world_size(), name, s)
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
            rounds[name].append(gathered)
            if dist.get_rank() == 0:
                wall = statistics.median(max(x["step_seconds"][i] for x in gathered) for i in range(s["steps"]))
                print(f"  round {r + 1}/{args.rounds} {name}: {1000 * wall:.1f} ms/step", flush=True)
    dist.destroy_process_group()
    return {name: summarize(name, rounds[name], fresh_processes=False) for name in args.configs}


def main():
    args = parse_args()
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
    s = settings_of(args)
    sizes = [p.numel() for p in make_model(s["seed"], **s["model"]).parameters()]
    num_params = sum(sizes)
    # Parameters zeroshard-stage3 keeps gathered (numel <= threshold, as in engine_stage3.cpp).
    kept = sum(n for n in sizes if n <= s["persistence_threshold"])
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else args.world_size
    leader = not under_torchrun or os.environ.get("RANK", "0") == "0"
    if leader:
        print(f"torch {torch.__version__}, {world} Gloo ranks on CPU, 1 thread per rank "
              f"({os.cpu_count()} CPUs), launched by {'torchrun' if under_torchrun else 'spawn (one group per config)'}; "
              f"load average now {os.getloadavg()[0]:.1f}")
        print(f"model: GPT {s['model']}, {num_params:,} parameters ({num_params * 4 / MB:.1f} MB fp32)")
        print(f"per rank: batch {s['batch']} x {s['seq']} tokens; {s['warmup']} warm-up + {s['steps']} timed steps; "
              f"AdamW lr {s['lr']} wd {s['weight_decay']}, torch fused={s['fused']}; "
              f"buckets {s['bucket_elems']:,} elements; {args.rounds} round(s)", flush=True)
        if "zeroshard-stage3" in args.configs:
            print(f"zeroshard-stage3: stage3_param_persistence_threshold {s['persistence_threshold']:,}: "
                  f"{kept:,} parameters ({100 * kept / num_params:.1f}%) stay gathered", flush=True)

    results = run_torchrun(args, s) if under_torchrun else run_spawned(args, s)
    if not leader:
        return 0
    configs = args.configs
    threads = sorted({r["threads"] for r in results.values()})
    print(f"torch threads per rank, as measured inside the ranks: {threads}")
    print()
    if "ddp" in results:
        print("## Against DDP + AdamW\n")
        print(render(results, "ddp", configs))
        print()
    zero_rows = [c for c in configs if c in ("zeroshard-stage1", "zeroshard-stage2", "ddp+zero-redundancy")]
    if "ddp+zero-redundancy" in results and len(zero_rows) > 1:
        print("## Against DDP + ZeroRedundancyOptimizer(AdamW)\n")
        print(render(results, "ddp+zero-redundancy", zero_rows))
        print()
    stage3_bases = [c for c in ("fsdp2", "zeroshard-stage2") if c in results]
    if "zeroshard-stage3" in results and stage3_bases:
        print(f"## zeroshard stage 3 against {' and '.join(stage3_bases)}\n")
        print(render(results, stage3_bases, ["zeroshard-stage3", *stage3_bases]))
        print()
    print("## Model-state memory per rank (the rank holding most)\n")
    print(render_memory(results, configs, num_params, world, kept))
    print()
    print("## Losses (mean over ranks; held-out: one fixed batch after the last step)\n")
    print(render_losses(results, configs))
    problems, warnings = check(results, world, os.cpu_count())
    print()
    print("\n".join(f"PROBLEM: {p}" for p in problems) if problems else "checks: all losses finite; "
          f"every config's held-out loss within 1e-3 of {loss_reference(results)}'s; ranks agree")
    for w in warnings:
        print(f"WARNING: {w}")

    if args.json:
        raw = dict(torch=torch.__version__, world_size=world, threads_per_rank=1, cpus=os.cpu_count(),
                   launcher="torchrun" if under_torchrun else "spawn", num_params=num_params, settings=s,
                   results=results, problems=problems, warnings=warnings)
        Path(args.json).write_text(json.dumps(raw, indent=2))
        print(f"raw numbers: {args.json}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
