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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt import make_model, next_token_loss, token_batch  # noqa: E402
from model_state import param_numel, persistent_numel  # noqa: E402
from ranks import run_ranks  # noqa: E402
from stage_report import MB, check, loss_reference, render, render_losses, render_memory, summarize  # noqa: E402
from steps import FP32_CONFIGS as CONFIGS, Recipe, fused_adamw_works, make_step, state_formula  # noqa: E402

LOSS_TOLERANCE = 1e-3  # relative, held-out loss against ddp's: every config computes the same fp32 steps


def _rss_bytes():
    # ru_maxrss is in KiB on Linux: the peak resident set of this process so far.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_config(rank, world_size, name, s):
    """Trains the benchmark model with config `name` on this rank; returns its raw numbers."""
    rss_before = _rss_bytes()
    model = make_model(s["seed"], **s["model"])
    vocab = s["model"]["vocab"]
    batches = [token_batch(s["seed"], i, rank, s["batch"], s["seq"], vocab) for i in range(s["warmup"] + s["steps"])]
    step = make_step(name, model, recipe_of(s))

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
    # Forward in the config's own precision (autocast for ddp-autocast); the cross-entropy in
    # fp32 so that a bf16 loss's 3 significant digits do not blur the comparison.
    model.eval()
    with torch.no_grad():
        held_out = token_batch(s["seed"] + 1, 0, 0, s["batch"], s["seq"], vocab)
        with step.forward_context():
            logits = model(held_out[:, :-1])
        eval_loss = next_token_loss(logits.float(), held_out).item()
    peak_rss = _rss_bytes()  # before extras(), which may allocate
    return dict(rank=rank, config=name, optimizer=step.optimizer_name, step_seconds=times,
                step_cpu_seconds=cpu_times, losses=losses, load_average=(load_before[0], load_after[0]),
                eval_loss=eval_loss, memory=memory, rss_before_bytes=rss_before, peak_rss_bytes=peak_rss,
                threads=torch.get_num_threads(), extras=step.extras())


# ---------------------------------------------------------------------------------------------
# Launch


def build_parser(doc, configs, steps=20, warmup=5, rounds=2, batch=8, quick="1 round of 2 warm-up + 5 timed steps"):
    """The command line of bench_stages.py; bench_bf16.py builds the same one with its defaults."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=steps, help=f"timed steps per config (default {steps})")
    p.add_argument("--warmup", type=int, default=warmup, help=f"untimed steps first (default {warmup})")
    p.add_argument("--rounds", type=int, default=rounds,
                   help=f"run every config this many times, in alternating order (default {rounds})")
    p.add_argument("--quick", action="store_true", help=f"smoke run: {quick}")
    p.add_argument("--batch", type=int, default=batch, help=f"sequences per rank per step (default {batch})")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--bucket-elems", type=int, default=1_500_000,
                   help="zeroshard reduce_bucket_size, and DDP bucket_cap_mb of the same bytes in fp32")
    p.add_argument("--persistence-threshold", type=int, default=10_000,
                   help="zeroshard stage 3's stage3_param_persistence_threshold (default 1e4: every "
                        "weight matrix sharded, biases and LayerNorms kept gathered)")
    p.add_argument("--overlap-comm", choices=("on", "off"), default="on",
                   help="zeroshard's zero_optimization.overlap_comm at every stage (default on, as DDP and "
                        "FSDP2 overlap their reductions; DeepSpeed's default is off below stage 3)")
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    p.add_argument("--configs", default=",".join(configs), help="comma-separated subset of " + ", ".join(configs))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one config may take")
    p.add_argument("--json", metavar="PATH", help="write the raw numbers here")
    return p


def parse_args(p=None, configs=CONFIGS, quick=(5, 2, 1)):
    """quick: (steps, warmup, rounds) of --quick."""
    p = p or build_parser(__doc__, configs)
    args = p.parse_args()
    if args.quick:
        args.steps, args.warmup, args.rounds = quick
    chosen = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(chosen) - set(configs))
    if unknown:
        p.error(f"unknown configs {unknown}; choose from {', '.join(configs)}")
    args.configs = chosen
    return args


def settings_of(args):
    return dict(steps=args.steps, warmup=args.warmup, batch=args.batch, seq=args.seq, seed=args.seed,
                bucket_elems=args.bucket_elems, persistence_threshold=args.persistence_threshold,
                overlap_comm=getattr(args, "overlap_comm", "on") == "on", lr=1e-3, weight_decay=0.01,
                fused=fused_adamw_works(),
                model=dict(vocab=512, dim=256, heads=4, hidden=1024, layers=args.layers, max_seq=args.seq))


def recipe_of(s):
    return Recipe(batch=s["batch"], lr=s["lr"], weight_decay=s["weight_decay"], fused=s["fused"],
                  bucket_elems=s["bucket_elems"], overlap_comm=s["overlap_comm"],
                  persistence_threshold=s["persistence_threshold"])


def formulas_of(run, configs):
    """Each config's model-state formula for this run (steps.state_formula)."""
    return {name: state_formula(name, run["num_params"], run["world"], run["kept"]) for name in configs}


def _round_orders(args):
    # Alternating order (A B C, C B A, ...) spreads slow drifts of the machine over all configs.
    return [args.configs if r % 2 == 0 else args.configs[::-1] for r in range(args.rounds)]


def run_spawned(args, s):
    """One fresh group of processes per config and round, so each peak RSS belongs to one
    config (ranks.run_ranks: one torch thread per rank, joined in a Gloo group)."""
    rounds = {name: [] for name in args.configs}
    for r, order in enumerate(_round_orders(args)):
        for name in order:
            t0 = time.perf_counter()
            ranks = run_ranks(run_config, args.world_size, name, s, timeout=args.timeout)
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


def start(args):
    """Settings, model size and launcher; prints the run's header on the leader."""
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
    s = settings_of(args)
    model = make_model(s["seed"], **s["model"])
    num_params = param_numel(model)
    kept = persistent_numel([p.numel() for p in model.parameters()], s["persistence_threshold"])
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else args.world_size
    leader = not under_torchrun or os.environ.get("RANK", "0") == "0"
    if leader:
        print(f"torch {torch.__version__}, {world} Gloo ranks on CPU, 1 thread per rank "
              f"({os.cpu_count()} CPUs), launched by {'torchrun' if under_torchrun else 'spawn (one group per config)'}; "
              f"load average now {os.getloadavg()[0]:.1f}")
        print(f"model: GPT {s['model']}, {num_params:,} parameters ({num_params * 4 / MB:.1f} MB fp32)")
        print(f"per rank: batch {s['batch']} x {s['seq']} tokens; {s['warmup']} warm-up + {s['steps']} timed steps; "
              f"AdamW lr {s['lr']} wd {s['weight_decay']}, torch fused={s['fused']}; "
              f"buckets {s['bucket_elems']:,} elements, zeroshard overlap_comm {'on' if s['overlap_comm'] else 'off'}; "
              f"{args.rounds} round(s)", flush=True)
        if any(c.startswith("zeroshard-stage3") for c in args.configs):
            print(f"zeroshard stage 3: stage3_param_persistence_threshold {s['persistence_threshold']:,}: "
                  f"{kept:,} parameters ({100 * kept / num_params:.1f}%) stay gathered", flush=True)
    results = run_torchrun(args, s) if under_torchrun else run_spawned(args, s)
    if leader:
        threads = sorted({r["threads"] for r in results.values()})
        print(f"torch threads per rank, as measured inside the ranks: {threads}")
        print()
    return dict(results=results, settings=s, num_params=num_params, kept=kept, world=world, leader=leader,
                launcher="torchrun" if under_torchrun else "spawn")


def write_json(path, run, problems, warnings):
    raw = dict(torch=torch.__version__, world_size=run["world"], threads_per_rank=1, cpus=os.cpu_count(),
               launcher=run["launcher"], num_params=run["num_params"], settings=run["settings"],
               results=run["results"], problems=problems, warnings=warnings)
    Path(path).write_text(json.dumps(raw, indent=2))
    print(f"raw numbers: {path}")


def main():
    args = parse_args()
    run = start(args)
    if not run["leader"]:
        return 0
    results, world = run["results"], run["world"]
    configs = args.configs
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
    print(render_memory(results, configs, formulas_of(run, configs)))
    print()
    print("## Losses (mean over ranks; held-out: one fixed batch after the last step)\n")
    print(render_losses(results, configs, "ddp"))
    problems, warnings = check(results, world, os.cpu_count(), "ddp", LOSS_TOLERANCE)
    print()
    print("\n".join(f"PROBLEM: {p}" for p in problems) if problems else "checks: all losses finite; "
          f"every config's held-out loss within {LOSS_TOLERANCE:g} of {loss_reference(results, 'ddp')}'s; ranks agree")
    for w in warnings:
        print(f"WARNING: {w}")

    if args.json:
        write_json(args.json, run, problems, warnings)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
