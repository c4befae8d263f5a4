"""The engine's own cost of an optimizer step (issue 33): engine.step() against the work it
cannot avoid, measured in the same processes.

World size 1 (one process, torch's threads): a stage-1 fp32 engine over 4 flat parameters of
N/4 elements each (bench_offload's FlatChunks, one bucket each), no offload, no clipping; timed:
engine.step() after a backward. Its floor is torch._fused_adamw_ on the same 4 tensors in one
call, as the engine makes it (the "kernel"). The ratio step / kernel is the engine's overhead
(goal: at most 1.25 at 2^24 and 2^26). The same engine with zeroshard.nonfinite "off" shows what
the nonfinite check's one read of the gradients costs. Because work can move from the step into
the backward (the engine copies a window's first gradient into its flat buffer there), the
backward and the step are also timed together, against plain torch doing the same: backward into
fresh .grad tensors, the kernel on them, .grad set to None (zero_grad's default). Both end with
bitwise the same weights (the run says so: same_weights_as_torch).

2 Gloo ranks (one thread each), stages 1 and 2: the step steps this rank's half and all-gathers
the parameters; its floor is the kernel on a half plus an all-gather of each bucket, all
started before any is waited for as the engine starts them (goal: step within kernel +
all-gather), both timed on the same ranks between the engine's steps.

    python benchmarks/bench_step.py                  # 2^24 and 2^26, about a minute
    python benchmarks/bench_step.py --sizes 65536 --reps 2   # smoke run
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_offload import BETAS, CHUNKS, EPS, LR, WEIGHT_DECAY, FlatChunks, _grad_value, _initial  # noqa: E402
from ranks import run_ranks  # noqa: E402


def _engine(numel, stage, nonfinite="error"):
    import zeroshard

    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                        "weight_decay": WEIGHT_DECAY}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": numel // CHUNKS},
              "zeroshard": {"nonfinite": nonfinite}}
    return zeroshard.initialize(FlatChunks(_initial(numel)), config)


# Each stepper makes one step and returns the seconds its timed part took. The peers of one
# table are stepped in turn, step by step, so that a load on the machine falls on all of them.

def _engine_stepper(numel, stage, nonfinite="error", with_backward=False):
    """Seconds of engine.step(); with_backward: (that, backward + step)."""
    engine, count = _engine(numel, stage, nonfinite), [0]

    def one():
        loss = engine(torch.tensor(_grad_value(count[0])))
        count[0] += 1
        t0 = time.perf_counter()
        engine.backward(loss)
        t1 = time.perf_counter()
        engine.step()
        t2 = time.perf_counter()
        return (t2 - t1, t2 - t0) if with_backward else t2 - t1
    one.weights = lambda: [p.detach() for p in engine.module.parameters()]
    return one


def _adamw(params, grads, avgs, sqs, steps):
    torch._fused_adamw_(params, grads, avgs, sqs, [], steps, lr=LR, beta1=BETAS[0], beta2=BETAS[1],
                        weight_decay=WEIGHT_DECAY, eps=EPS, amsgrad=False, maximize=False)


def _torch_stepper(numel):
    """Plain torch at world size 1: the same module's backward into fresh .grad tensors, the
    kernel on them in one call, then .grad = None; timed from the backward."""
    model, count = FlatChunks(_initial(numel)), [0]
    params = list(model.parameters())
    avgs, sqs = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    steps = [torch.zeros(()) for _ in params]

    def one():
        loss = model(torch.tensor(_grad_value(count[0])))
        count[0] += 1
        t0 = time.perf_counter()
        loss.backward()
        with torch.no_grad():
            torch._foreach_add_(steps, 1)
            _adamw(params, [p.grad for p in params], avgs, sqs, steps)
        for p in params:
            p.grad = None
        return time.perf_counter() - t0
    one.weights = lambda: [p.detach() for p in params]
    return one


def _kernel_stepper(shard_numel):
    """torch._fused_adamw_ on CHUNKS tensors of shard_numel elements each, in one call."""
    g = torch.Generator().manual_seed(shard_numel)
    params = [torch.randn(shard_numel, generator=g) * 0.02 for _ in range(CHUNKS)]
    grads, avgs, sqs = ([torch.zeros_like(p) for p in params] for _ in range(3))
    steps, count = [torch.zeros(()) for _ in params], [0]

    def one():
        for grad, step in zip(grads, steps):
            grad.fill_(_grad_value(count[0]))
            step += 1
        count[0] += 1
        t0 = time.perf_counter()
        _adamw(params, grads, avgs, sqs, steps)
        return time.perf_counter() - t0
    return one


def _gather_stepper(numel, world_size):
    """An all-gather of each bucket's parameters from this rank's share, all started at once."""
    full = [torch.empty(numel // CHUNKS) for _ in range(CHUNKS)]
    shards = [torch.randn(numel // CHUNKS // world_size) for _ in range(CHUNKS)]

    def one():
        dist.barrier()
        t0 = time.perf_counter()
        # Every bucket's gather started before any is waited for, as the engine does.
        for work in [dist.all_gather_into_tensor(out, shard, async_op=True) for out, shard in zip(full, shards)]:
            work.wait()
        return time.perf_counter() - t0
    return one


def _medians_ms(steppers, warmup, reps):
    """{name: median ms}; a stepper returning (a, b) gives name and name + "+backward"."""
    seconds = {}
    for _ in range(warmup + reps):
        for name, one in steppers.items():
            took = one()
            for key, value in ((name, took),) if not isinstance(took, tuple) else ((name, took[0]),
                                                                                   (f"{name}+backward", took[1])):
                seconds.setdefault(key, []).append(value)
    return {name: 1000 * statistics.median(s[warmup:]) for name, s in seconds.items()}


def one_rank(rank, world_size, sizes, warmup, reps, threads):
    torch.set_num_threads(threads)
    rows = []
    for numel in sizes:
        steppers = {"kernel": _kernel_stepper(numel // CHUNKS), "step": _engine_stepper(numel, 1, with_backward=True),
                    "unchecked": _engine_stepper(numel, 1, nonfinite="off"), "torch": _torch_stepper(numel)}
        ms = _medians_ms(steppers, warmup, reps)
        # Like against like: the engine and plain torch took the same steps from the same start.
        same = [all(torch.equal(a, b) for a, b in zip(steppers[name].weights(), steppers["torch"].weights()))
                for name in ("step", "unchecked")]
        rows.append(dict(numel=numel, kernel_ms=ms["kernel"], step_ms=ms["step"], step_unchecked_ms=ms["unchecked"],
                         ratio=ms["step"] / ms["kernel"], ratio_unchecked=ms["unchecked"] / ms["kernel"],
                         backward_step_ms=ms["step+backward"], torch_backward_step_ms=ms["torch"],
                         ratio_backward_step=ms["step+backward"] / ms["torch"], same_weights_as_torch=all(same)))
    return rows


def two_ranks(rank, world_size, sizes, warmup, reps):
    rows = []
    for numel in sizes:
        ms = _medians_ms({"kernel": _kernel_stepper(numel // CHUNKS // world_size),
                          "gather": _gather_stepper(numel, world_size),
                          1: _engine_stepper(numel, 1), 2: _engine_stepper(numel, 2)}, warmup, reps)
        for stage in (1, 2):
            rows.append(dict(numel=numel, stage=stage, kernel_ms=ms["kernel"], gather_ms=ms["gather"],
                             step_ms=ms[stage], ratio=ms[stage] / (ms["kernel"] + ms["gather"])))
    return rows


def _size(n):
    exponent = n.bit_length() - 1
    return f"2^{exponent}" if n == 1 << exponent else str(n)


def render(one, two, world_size, threads):
    lines = [f"World size 1 ({threads} threads), stage 1 fp32, no offload, no clipping; median ms:", "",
             "| N | kernel | engine.step() | × kernel | nonfinite \"off\" | × kernel |", "|---|---:|---:|---:|---:|---:|"]
    for r in one:
        lines.append(f"| {_size(r['numel'])} | {r['kernel_ms']:.1f} | {r['step_ms']:.1f} | {r['ratio']:.2f} "
                     f"| {r['step_unchecked_ms']:.1f} | {r['ratio_unchecked']:.2f} |")
    lines += ["", "Backward and step together (the engine's against plain torch's: backward, the kernel, .grad = None):", "",
              "| N | torch | engine | × torch |", "|---|---:|---:|---:|"]
    for r in one:
        lines.append(f"| {_size(r['numel'])} | {r['torch_backward_step_ms']:.1f} | {r['backward_step_ms']:.1f} "
                     f"| {r['ratio_backward_step']:.2f} |")
    lines += ["", f"{world_size} Gloo ranks (1 thread each), the slowest rank's medians, ms:", "",
              "| N | stage | kernel on the shard | all-gather | kernel + all-gather | engine.step() | × (kernel + all-gather) |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for r in two:
        lines.append(f"| {_size(r['numel'])} | {r['stage']} | {r['kernel_ms']:.1f} | {r['gather_ms']:.1f} "
                     f"| {r['kernel_ms'] + r['gather_ms']:.1f} | {r['step_ms']:.1f} | {r['ratio']:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=f"{2**24},{2**26}", help="comma-separated element counts")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="world size 1's torch threads (default: torch's)")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    if any(n % (16 * CHUNKS) for n in sizes):
        raise SystemExit(f"bench_step.py: --sizes must be multiples of {16 * CHUNKS}")
    threads = args.threads or torch.get_num_threads()
    world_size = 2
    one = run_ranks(one_rank, 1, sizes, args.warmup, args.reps, threads, timeout=args.timeout)[0]
    ranks = run_ranks(two_ranks, world_size, sizes, args.warmup, args.reps, timeout=args.timeout)
    two = [max(rows, key=lambda r: r["step_ms"]) for rows in zip(*ranks)]
    text = (f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
            f"median of {args.reps} steps after {args.warmup}\n\n" + render(one, two, world_size, threads))
    if args.json:
        Path(args.json).write_text(json.dumps({"one_rank": one, "two_ranks": two}, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
