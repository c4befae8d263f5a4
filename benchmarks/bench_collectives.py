"""The collectives the stages are built from, alone: all-reduce (DDP, stage 0), reduce-scatter +
all-gather (stages 1 and 2; stage 3 adds a second all-gather), on one buffer, through
torch.distributed's Gloo group on CPU.

    python benchmarks/bench_collectives.py                    # 2 ranks, 5M fp32 elements (20 MB)
    python benchmarks/bench_collectives.py --numel 50000000 --world-size 4

Each rank times --repeats calls of each collective after --warmup, between barriers; printed:
median wall ms and CPU ms of the slowest rank, and the ratio of reduce-scatter + all-gather to
all-reduce (1.0 means the sharded stages pay nothing extra for their communication).
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ranks import run_ranks  # noqa: E402


def _rank(rank, world_size, numel, repeats, warmup):
    import torch.distributed as dist

    # One torch thread, as every rank of ranks.run_ranks (bench_stages.py's too).
    numel -= numel % world_size
    flat = torch.randn(numel)
    shard = torch.empty(numel // world_size)
    gathered = torch.empty(numel)
    # torch 2.13 renamed the single-tensor forms (the old names warn there).
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    calls = {"all_reduce": lambda: dist.all_reduce(flat),
             "reduce_scatter": lambda: reduce_scatter(shard, flat),
             "all_gather": lambda: all_gather(gathered, shard)}
    out = {}
    for name, call in calls.items():
        walls, cpus = [], []
        for i in range(warmup + repeats):
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            call()
            if i >= warmup:
                walls.append(time.perf_counter() - t)
                cpus.append(time.process_time() - c)
        out[name] = (walls, cpus)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=5_000_000, help="fp32 elements of the full buffer")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    ranks = run_ranks(_rank, args.world_size, args.numel, args.repeats, args.warmup)
    mb = args.numel * 4 / 2**20
    print(f"torch {torch.__version__}, {args.world_size} ranks, Gloo, "
          f"{args.numel:,} fp32 elements ({mb:.1f} MiB), {args.repeats} timed calls each; "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| collective | wall ms (median, slowest rank) | CPU ms (median, slowest rank) |")
    print("|---|---:|---:|")
    wall = {}
    for name in ("all_reduce", "reduce_scatter", "all_gather"):
        wall[name] = statistics.median(max(r[name][0][i] for r in ranks) for i in range(args.repeats)) * 1e3
        cpu = statistics.median(max(r[name][1][i] for r in ranks) for i in range(args.repeats)) * 1e3
        print(f"| {name} | {wall[name]:.2f} | {cpu:.2f} |")
    ratio = (wall["reduce_scatter"] + wall["all_gather"]) / wall["all_reduce"]
    print(f"\n(reduce_scatter + all_gather) / all_reduce: {ratio:.2f}")


if __name__ == "__main__":
    main()
