"""python -m zeroshard check: do this machine's links carry the collectives fast enough to shard?

Run under torchrun, one process per GPU (NCCL) or per CPU rank (Gloo on CPU):

    torchrun --nproc-per-node 4 -m zeroshard check
    torchrun --nproc-per-node 2 -m zeroshard check --sizes 1MiB,64MiB --iters 5 --json check.json

1. Times all-reduce, reduce-scatter and all-gather of float32 buffers of a few sizes (default
   1 MiB, 16 MiB, 256 MiB, 1 GiB on GPUs; up to --max-size, 64 MiB by default, on CPU): --warmup
   calls, then --iters timed calls between device synchronisations; the time is the mean per
   call on the slowest rank (the elapsed time all-reduced with MAX). Printed per collective and
   size: time, algorithm bandwidth and bus bandwidth by nccl-tests' definitions (Note
   [nccl-tests bandwidth] in zeroshard/bandwidth.py):
       algbw = S / t, S the full buffer (all-reduce buffer, reduce-scatter input, all-gather output)
       busbw = algbw * 2(n-1)/n (all-reduce), algbw * (n-1)/n (reduce-scatter, all-gather)
2. Names the link class the best busbw looks like (bandwidth.GPU_LINK_CLASSES, with sources).
3. Prints `nvidia-smi topo -m` when nvidia-smi is on PATH, and its reading for the GPUs in use.
4. Note [scaling check]: times one data-parallel step of a fixed global size, --compute FLOPs
   of square matmuls split evenly over the ranks followed by the all-reduce of a --grad-size
   gradient, on all n ranks, and the same global compute on rank 0 alone (the others wait; one
   rank has no gradient to all-reduce). speedup = t(1 rank) / t(n ranks), ideally n. Below
   --min-efficiency * n (0.65: 1.3x for 2 ranks) it warns: the step then spends over a third of
   its time beyond the ideal, in communication or contention, so each card added buys little.
   There is no overlap of compute and communication here (the engine's overlap_comm has some),
   so the speedup is a floor of what training sees at this ratio of compute to gradient bytes.

Every line comes from rank 0; --json PATH writes every number; --timeout bounds each collective.
"""

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from zeroshard import bandwidth, topology
from zeroshard.bandwidth import COLLECTIVES, format_size, parse_size
from zeroshard.launch import init_distributed

_DEFAULT_SIZES = [2**20, 16 * 2**20, 256 * 2**20, 2**30]
_DEFAULTS = {  # per device: max size, grad size, compute FLOPs, the matmul's side and dtype
    # GPU: the gradients of a 134M-parameter model in bf16 and 6 * 134M * 32k tokens of compute.
    "cuda": {"max_size": 2**30, "grad_size": 256 * 2**20, "compute": 2.6e13, "matmul": (4096, torch.bfloat16)},
    "cpu": {"max_size": 64 * 2**20, "grad_size": 4 * 2**20, "compute": 2e9, "matmul": (256, torch.float32)},
}
_FLOP_UNITS = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}


class FlagError(ValueError):
    """A flag this group cannot run with (every rank finds it alike, rank 0 says it)."""


class _RankZeroParser(argparse.ArgumentParser):
    """Usage and errors printed by rank 0 only (every rank parses the same argv under torchrun)."""

    def _print_message(self, message, file=None):
        if os.environ.get("RANK", "0") == "0":
            super()._print_message(message, file)


def _checked(parse):
    def parse_flag(text):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse_flag


def _sizes(text):
    return [parse_size(part) for part in text.split(",")]


def _flops(text):
    t = text.strip().lower()
    value = float(t[:-1]) * _FLOP_UNITS[t[-1]] if t[-1:] in _FLOP_UNITS else float(t)
    if not value > 0 or math.isinf(value):
        raise ValueError(f"{text!r} is not a positive number of FLOPs (e.g. 2.6e13 or 26T)")
    return value


def _at_least(kind, low):
    def parse(text):
        value = kind(text)
        if not value >= low:
            raise ValueError(f"{text!r} is less than {low}")
        return value
    return parse


def _parser():
    p = _RankZeroParser(prog="python -m zeroshard check", description=__doc__.split("\n\n")[0],
                        epilog="Definitions and thresholds: docs/check.md")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--sizes", type=_checked(_sizes), help="comma-separated buffer sizes S, e.g. 4KiB,1MiB,1GiB")
    which.add_argument("--max-size", type=_checked(parse_size),
                       help="the default sizes up to this one (default 1GiB on GPUs, 64MiB on CPU)")
    p.add_argument("--iters", type=_checked(_at_least(int, 1)), default=20, help="timed calls per size (20)")
    p.add_argument("--warmup", type=_checked(_at_least(int, 0)), default=5, help="untimed calls first (5)")
    p.add_argument("--grad-size", type=_checked(parse_size),
                   help="gradient all-reduced by the scaling step (256MiB on GPUs, 4MiB on CPU)")
    p.add_argument("--compute", type=_checked(_flops),
                   help="global matmul FLOPs of the scaling step (2.6e13 on GPUs, 2e9 on CPU)")
    p.add_argument("--min-efficiency", type=_checked(_at_least(float, 0.0)), default=0.65,
                   help="warn when speedup < this * ranks (0.65: 1.3x for 2 ranks)")
    p.add_argument("--timeout", type=_checked(_at_least(float, 1.0)), default=300.0,
                   help="seconds any collective may take before it fails (300)")
    p.add_argument("--json", metavar="PATH", help="write every number here (rank 0)")
    return p


class _Ranks:
    """The group as the check uses it: its size, the device of its collectives, the sync."""

    def __init__(self):
        config = dist.get_backend_config()
        self.backend = "nccl" if "nccl" in config else "gloo"
        gpu = self.backend == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
        self._scalar_device = "cpu" if "cpu:gloo" in config or self.backend == "gloo" else self.device
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.local_size = int(os.environ.get("LOCAL_WORLD_SIZE", self.size))
        self.nodes = max(1, self.size // self.local_size)

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def max(self, value):
        """The largest `value` of all ranks (blocks until every rank gives one)."""
        t = torch.tensor([value], dtype=torch.float64, device=self._scalar_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def timed(self, call, iters, warmup):
        """Seconds per call of `call` on the slowest rank, after `warmup` calls."""
        for _ in range(warmup):
            call()
        self.sync()
        self.max(0.0)  # start together
        start = time.perf_counter()
        for _ in range(iters):
            call()
        self.sync()
        return self.max((time.perf_counter() - start) / iters)


def _collective_calls(ranks, nbytes):
    """{collective: a call on a full buffer of nbytes} (float32; each rank's part nbytes / n)."""
    part = torch.ones(nbytes // 4 // ranks.size, device=ranks.device)
    full = torch.ones(part.numel() * ranks.size, device=ranks.device)
    # torch 2.13 renamed the single-tensor forms (the old names warn there).
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return {"all_reduce": lambda: dist.all_reduce(full), "reduce_scatter": lambda: reduce_scatter(part, full),
            "all_gather": lambda: all_gather(full, part)}, full.numel() * 4


def _time_collectives(ranks, sizes, iters, warmup):
    rows = []
    for requested in sizes:
        calls, nbytes = _collective_calls(ranks, requested)
        for name in COLLECTIVES:
            seconds = ranks.timed(calls[name], iters, warmup)
            algbw, busbw = bandwidth.bandwidths(name, nbytes, seconds, ranks.size)
            rows.append({"collective": name, "bytes": nbytes, "requested_bytes": requested, "seconds": seconds,
                         "algbw_GBps": algbw, "busbw_GBps": busbw,
                         "bus_factor": bandwidth.bus_factor(name, ranks.size)})
        del calls
    return rows


def _scaling(ranks, args, defaults):
    """Note [scaling check]: {"one_rank_seconds", "ranks_seconds", "speedup", ...}."""
    side, dtype = defaults["matmul"]
    per_matmul = 2.0 * side**3
    matmuls = max(1, math.ceil(args.compute / per_matmul / ranks.size)) * ranks.size  # an equal share each
    a = torch.randn(side, side, device=ranks.device).to(dtype)
    out = torch.empty_like(a)
    grad = torch.ones(max(1, args.grad_size // a.element_size()), dtype=dtype, device=ranks.device)

    def step(count, reduce):
        for _ in range(count):
            torch.matmul(a, a, out=out)
        if reduce:
            dist.all_reduce(grad)

    iters, warmup = args.iters, args.warmup
    alone = (lambda: step(matmuls, False)) if ranks.rank == 0 else (lambda: None)
    one = ranks.timed(alone, iters, warmup)  # the others wait in the closing max
    many = ranks.timed(lambda: step(matmuls // ranks.size, True), iters, warmup)
    # The same share without the all-reduce: what is lost to communication vs to ranks slowing
    # each other's compute (shared cores, memory bandwidth, power).
    share = ranks.timed(lambda: step(matmuls // ranks.size, False), iters, warmup)
    speedup = one / many
    threshold = args.min_efficiency * ranks.size
    return {"matmuls": matmuls, "matmul_side": side, "dtype": str(dtype).replace("torch.", ""),
            "flops": matmuls * per_matmul, "grad_bytes": grad.numel() * grad.element_size(),
            "one_rank_seconds": one, "ranks_seconds": many, "compute_share_seconds": share,
            "communication_seconds": max(0.0, many - share), "contention_seconds": max(0.0, share - one / ranks.size),
            "speedup": speedup,
            "efficiency": speedup / ranks.size, "min_efficiency": args.min_efficiency,
            "threshold_speedup": threshold, "warned": speedup < threshold}


def _table(rows, ranks):
    lines = [f"{'collective':<15}{'size':>10}{'time (us)':>14}{'algbw (GB/s)':>15}{'busbw (GB/s)':>15}"]
    for r in rows:
        lines.append(f"{r['collective']:<15}{format_size(r['bytes']):>10}{r['seconds'] * 1e6:>14.1f}"
                     f"{r['algbw_GBps']:>15.3f}{r['busbw_GBps']:>15.3f}")
    n = ranks.size
    lines.append(f"algbw = S / t, S the full buffer (the all-reduce buffer, the reduce-scatter input, the "
                 f"all-gather output); busbw = algbw * 2(n-1)/n for all_reduce, * (n-1)/n for reduce_scatter "
                 f"and all_gather; n = {n}, GB = 1e9 bytes (nccl-tests, doc/PERFORMANCE.md)")
    return lines


def _link_lines(rows, ranks):
    best = max(rows, key=lambda r: r["busbw_GBps"])
    cls = bandwidth.link_class(best["busbw_GBps"], ranks.backend)
    out = {"best_busbw_GBps": best["busbw_GBps"], "best_collective": best["collective"], "best_bytes": best["bytes"],
           "class": cls.name if cls else None, "class_floor_GBps": cls.floor if cls else None,
           "class_typical_GBps": cls.typical if cls else None, "source": cls.source if cls else None}
    if cls is None:
        return out, ["link: 1 rank, no link crossed (launch with torchrun --nproc-per-node N)"]
    lines = [f"link: best busbw {best['busbw_GBps']:.2f} GB/s ({best['collective']}, {format_size(best['bytes'])}) "
             f"looks like {cls.name}"]
    if ranks.backend == "nccl":
        lines.append(f"  (called so from {cls.floor:g} GB/s; typical {cls.typical:g} GB/s: {cls.source})")
    if ranks.nodes > 1:
        lines.append(f"  the ranks span {ranks.nodes} nodes: the slowest hop is the network between them")
    return out, lines


def _topology_lines(ranks):
    text, why_not = topology.nvidia_smi_topo()
    if text is None:
        return {"available": False, "why": why_not}, [f"topology: {why_not}"]
    lines = ["nvidia-smi topo -m:", *("  " + line for line in text.rstrip().splitlines())]
    try:
        matrix = topology.parse_topo(text)
    except ValueError as e:
        return {"available": True, "text": text, "error": str(e)}, lines + [f"topology: {e}"]
    gpus = None
    if ranks.backend == "nccl":
        gpus = topology.gpus_in_use(ranks.local_size, os.environ.get("CUDA_VISIBLE_DEVICES"))
    reading = topology.read_topology(matrix, gpus)
    note = "" if ranks.backend == "nccl" else " (this run used no GPU: every GPU of the machine)"
    return {"available": True, "text": text, **reading}, lines + [f"topology{note}: {reading['reading']}"]


def _scaling_lines(s, ranks):
    n = ranks.size
    lines = [f"scaling: one data-parallel step = {s['matmuls']} matmuls {s['matmul_side']}x{s['matmul_side']} "
             f"{s['dtype']} ({s['flops'] / 1e9:.3g} GFLOP) over the ranks, then all_reduce of a "
             f"{format_size(s['grad_bytes'])} gradient",
             f"  1 rank (rank 0 alone, all the compute, nothing to reduce): {s['one_rank_seconds'] * 1e3:.2f} ms",
             f"  {n} ranks ({s['matmuls'] // n} matmuls each + the all_reduce): {s['ranks_seconds'] * 1e3:.2f} ms: "
             f"compute {s['compute_share_seconds'] * 1e3:.2f} ms (ideal {s['one_rank_seconds'] / n * 1e3:.2f}), "
             f"all_reduce ~{s['communication_seconds'] * 1e3:.2f} ms",
             f"  speedup {s['speedup']:.2f}x of an ideal {n}x (efficiency {s['efficiency']:.0%}); "
             f"warning below {s['threshold_speedup']:.2f}x ({s['min_efficiency']:.0%} of {n})"]
    return lines


def _warning(s, n):
    if s["communication_seconds"] >= s["contention_seconds"]:
        why = ("most of the loss is the all_reduce: the links are slow for this much gradient per step of "
               "compute; more compute per all-reduce (gradient accumulation, bigger micro-batches) or "
               "fewer ranks pays, and stage 3 (1.5x this traffic) will pay more")
    else:
        why = ("most of the loss is compute: the ranks slow each other (sharing CPU cores, memory "
               "bandwidth or power); run fewer ranks than cores, or on separate devices")
    return (f"zeroshard check: warning: {n} ranks run this step only {s['speedup']:.2f}x as fast as one, "
            f"below {s['threshold_speedup']:.2f}x ({s['min_efficiency']:.0%} of {n}): {why}")


def _count(n, what):
    return f"{n} {what}{'s' if n > 1 else ''}"


def run(args):
    """The check on the initialised group; returns {...every number...}, printing on rank 0."""
    ranks = _Ranks()
    say = (lambda *lines: print(*lines, sep="\n", flush=True)) if ranks.rank == 0 else (lambda *lines: None)
    defaults = _DEFAULTS[ranks.device.type]
    sizes = args.sizes or ([s for s in _DEFAULT_SIZES if s < (args.max_size or defaults["max_size"])]
                           + [args.max_size or defaults["max_size"]])
    args.grad_size = args.grad_size or defaults["grad_size"]
    args.compute = args.compute or defaults["compute"]
    smallest = 4 * ranks.size
    if min(sizes) < smallest:
        raise FlagError(f"--sizes: {format_size(min(sizes))} is less than one float32 per rank "
                        f"({smallest} B for {ranks.size} ranks)")
    where = (f"NCCL on {torch.cuda.get_device_name(ranks.device)}" if ranks.backend == "nccl" else "Gloo on CPU")
    say(f"zeroshard check: {_count(ranks.size, 'rank')} on {_count(ranks.nodes, 'node')}, {where}, "
        f"torch {torch.__version__}; "
        f"float32, {args.warmup} warm-up + {args.iters} timed calls, time = mean per call on the slowest rank")
    rows = _time_collectives(ranks, sizes, args.iters, args.warmup)
    say(*_table(rows, ranks))
    link, lines = _link_lines(rows, ranks)
    say(*lines)
    topo, lines = _topology_lines(ranks) if ranks.rank == 0 else (None, [])
    say(*lines)
    report = {"ranks": ranks.size, "nodes": ranks.nodes, "backend": ranks.backend, "device": str(ranks.device),
              "iters": args.iters, "warmup": args.warmup, "collectives": rows, "link": link, "topology": topo}
    if ranks.size > 1:
        report["scaling"] = s = _scaling(ranks, args, defaults)
        say(*_scaling_lines(s, ranks))
        if s["warned"] and ranks.rank == 0:
            print(_warning(s, ranks.size), file=sys.stderr, flush=True)
    else:
        say("scaling: 1 rank, nothing to compare (launch with torchrun --nproc-per-node N)")
    if args.json and ranks.rank == 0:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        say(f"numbers written to {args.json}")
    return report


def main(argv=None):
    """Entry point of `python -m zeroshard check`; returns the exit status (2: a bad flag)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # argparse's --help (0) or usage error (2)
        return e.code if isinstance(e.code, int) else 2
    started_here = not dist.is_initialized()
    init_distributed(timeout_seconds=args.timeout)
    try:
        run(args)
    except FlagError as e:
        if dist.get_rank() == 0:
            print(f"zeroshard check: error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        if started_here:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
