"""A picture of zeroshard's step: one torch.profiler Chrome trace per rank.

    python benchmarks/profile_step.py --out traces/              # stage 3, 2 Gloo ranks, CPU
    python benchmarks/profile_step.py --stage 0 --steps 3 --out traces/
    torchrun --nproc-per-node 2 benchmarks/profile_step.py --out traces/   # the same, under torchrun

Trains the GPT of bench_stages.py (gpt.py; --tiny: a small one) for --warmup untimed steps, then
profiles --steps steps with wall_clock_breakdown on, and writes traces/rank<r>.json (open it in
https://ui.perfetto.dev or chrome://tracing). The engine's phases are named spans
(Note [profiler names] in csrc/zeroshard/engine/engine.cpp):

    zeroshard::forward         the model's forward through the engine (Python)
    zeroshard::backward        engine.backward(): autograd and the gradient reductions
    zeroshard::reduce_bucket   a bucket's (stage 3: a unit's) reduction launched
    zeroshard::step            engine.step() at the accumulation boundary
    zeroshard::optimizer_step  the update: nonfinite check, clipping, fused AdamW, the copy back
    zeroshard::gather_params   stages 1-2: the parameters' all-gather after the update
    zeroshard::gather_unit     stage 3: a unit's all-gather launched (prefetched ones too)
    zeroshard::wait_unit       stage 3: waiting for a unit's gather before its forward / backward
    zeroshard::release_unit    stage 3: a unit's gathered parameters freed

and the collectives are c10d's own events (gloo:all_reduce, ...). Rank 0 prints, per phase, the
trace's mean milliseconds per step beside wall_clock_breakdown's for the same steps: both time
the same calls, so they agree up to the profiler's own overhead.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt import make_model, next_token_loss, token_batch  # noqa: E402

PHASES = ("zeroshard::forward", "zeroshard::backward", "zeroshard::step", "zeroshard::optimizer_step",
          "zeroshard::reduce_bucket", "zeroshard::gather_params", "zeroshard::gather_unit", "zeroshard::wait_unit",
          "zeroshard::release_unit")
# wall_clock_breakdown's fields for the phases it times too: forward from beginForward to
# endForward, backward and step around the same calls as the spans.
BREAKDOWN = {"zeroshard::forward": "forward_ms", "zeroshard::backward": "backward_ms", "zeroshard::step": "step_ms"}
FULL = dict(vocab=512, dim=256, heads=4, hidden=1024, layers=6)
TINY = dict(vocab=96, dim=32, heads=2, hidden=128, layers=2)


def phase_summary(trace_path, steps):
    """{phase: (count, mean ms per step)} of the zeroshard spans in a Chrome trace file."""
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    out = {}
    for e in events:
        # The host's spans; on a GPU the profiler repeats each on the device's timeline
        # ("gpu_user_annotation"), which would count it twice.
        if e.get("ph") == "X" and e.get("name") in PHASES and e.get("cat") != "gpu_user_annotation":
            count, total = out.get(e["name"], (0, 0.0))
            out[e["name"]] = (count + 1, total + e.get("dur", 0) / 1000.0)
    return {name: (count, total / steps) for name, (count, total) in out.items()}


def profile_rank(rank, world, args):
    import zeroshard

    sizes = TINY if args.tiny else FULL
    model = make_model(args.seed, **sizes)
    zero = {"stage": args.stage}
    extras = {}
    if args.stage == 3:
        # As bench_stages.py: only biases and LayerNorms stay gathered (the tiny GPT: none).
        zero["stage3_param_persistence_threshold"] = 0 if args.tiny else 10_000
        extras["stage3_unit_classes"] = ["Block"]
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
              "zero_optimization": zero, "wall_clock_breakdown": True, "steps_per_print": args.steps,
              "zeroshard": extras}
    engine = zeroshard.initialize(model, config)
    lines = []  # rank 0's steps_per_print lines, with the breakdown
    engine._core.set_log_sink(lines.append)

    def train(step):
        tokens = token_batch(args.seed, step, rank, args.batch, args.seq, sizes["vocab"])
        loss = next_token_loss(engine(tokens[:, :-1]), tokens)
        engine.backward(loss)
        engine.step()

    # The warm-up ends on a print step (warmup_steps() rounds it up to a multiple of --steps), so
    # the last line's breakdown covers the profiled steps alone.
    for step in range(args.warmup):
        train(step)
    lines.clear()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for step in range(args.warmup, args.warmup + args.steps):
            train(step)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"rank{rank}.json"
    prof.export_chrome_trace(str(path))
    return dict(trace=str(path), phases=phase_summary(path, args.steps), log=list(lines))


def breakdown_of(line):
    """wall_clock_breakdown's fields of a steps_per_print line ({"step_ms": ..., ...})."""
    fields = {}
    for part in line.split(", "):
        key, _, value = part.partition("=")
        if key.endswith("_ms"):
            fields[key] = float(value)
    return fields


def report(results, args):
    print(f"zeroshard stage {args.stage}, {len(results)} ranks, {args.steps} profiled steps after {args.warmup}")
    for r, result in enumerate(results):
        print(f"rank {r}: {result['trace']}")
    rank0 = results[0]
    breakdown = breakdown_of(rank0["log"][-1]) if rank0["log"] else {}
    print(f"{'phase (rank 0)':28} {'spans':>6} {'trace ms/step':>14} {'breakdown ms/step':>18}")
    for name in PHASES:
        if name not in rank0["phases"]:
            continue
        count, ms = rank0["phases"][name]
        other = breakdown.get(BREAKDOWN.get(name, ""), None)
        print(f"{name:28} {count:6d} {ms:14.2f} {'' if other is None else f'{other:18.2f}'}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="traces", help="folder for rank<r>.json")
    p.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3))
    p.add_argument("--steps", type=int, default=3, help="profiled steps")
    p.add_argument("--warmup", type=int, default=3, help="steps before the profiled ones (rounded up to a "
                   "multiple of --steps)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="a small GPT (a smoke run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args()
    args.warmup = -(-args.warmup // args.steps) * args.steps  # a multiple of --steps (see profile_rank)
    if "RANK" in os.environ:  # under torchrun: this process is one rank
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        result = profile_rank(rank, world, args)
        results = [None] * world
        dist.all_gather_object(results, result)
        if rank == 0:
            report(results, args)
        dist.destroy_process_group()
        return
    from ranks import run_ranks

    report(run_ranks(_entry, args.world_size, args, timeout=args.timeout), args)


def _entry(rank, world, args):
    return profile_rank(rank, world, args)


if __name__ == "__main__":
    main()
