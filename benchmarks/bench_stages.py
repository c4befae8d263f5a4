"""Step time and per-rank model-state memory of zeroshard stages 0-3 against DDP + AdamW,
DDP + ZeroRedundancyOptimizer(AdamW), FSDP2 (fully_shard) + AdamW and DeepSpeed's ZeRO stages
0-3 (the `deepspeed` package on CPU; left out, with the reason printed, where it does not
import), on one small GPT, 2 Gloo ranks on CPU. --compile adds the same configs compiled with
torch.compile (inductor): zeroshard's engine.compile(), FSDP2 with compiled blocks, compiled DDP.

    python benchmarks/bench_stages.py                      # spawns 2 ranks per config
    python benchmarks/bench_stages.py --quick              # smoke run, a few minutes
    python benchmarks/bench_stages.py --compile            # also the compiled configs
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
from compiled_steps import COMPILED, graphs_compiled  # noqa: E402
from deepspeed_steps import DEEPSPEED_CONFIGS, deepspeed_unavailable  # noqa: E402
from ranks import run_ranks  # noqa: E402
from stage_report import (MB, check, loss_reference, render, render_compiled, render_losses,  # noqa: E402
                          render_memory, render_pairs, summarize)
from steps import FP32_CONFIGS, Recipe, fused_adamw_works, make_step, state_formula  # noqa: E402

CONFIGS = FP32_CONFIGS + DEEPSPEED_CONFIGS
# The configs --compile adds a compiled twin of (compiled_steps.py).
COMPILABLE = ("zeroshard-stage0", "zeroshard-stage1", "zeroshard-stage2", "zeroshard-stage3", "ddp", "fsdp2")
LOSS_TOLERANCE = 1e-3  # relative, held-out loss against ddp's: every config computes the same fp32 steps
# Issue 33's goals on this benchmark (CPU ms per step, medians): stage 0 at most 1.02 x DDP's,
# stages 1 and 2 at most DeepSpeed's at the same stage.
STAGE0_OVER_DDP = 1.02


def _rss_bytes():
    # ru_maxrss is in KiB on Linux: the peak resident set of this process so far.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_config(rank, world_size, name, s):
    """Trains the benchmark model with config `name` on this rank; returns its raw numbers."""
    rss_before = _rss_bytes()
    model = make_model(s["seed"], **s["model"])
    vocab = s["model"]["vocab"]
    batches = [token_batch(s["seed"], i, rank, s["batch"], s["seq"], vocab) for i in range(s["warmup"] + s["steps"])]
    if name.endswith(COMPILED):
        # Under torchrun one process runs every config: each compiled one starts from an empty
        # dynamo cache, so it compiles its own graphs (and its first step's time says so).
        torch._dynamo.reset()
    step = make_step(name, model, recipe_of(s))

    times, cpu_times, warmup_times, losses = [], [], [], []
    compiled, graphs_before = name.endswith(COMPILED), None
    load_before = os.getloadavg()
    for i, tokens in enumerate(batches):
        if compiled and i == s["warmup"]:
            graphs_before = graphs_compiled()  # the warm-up compiled; the timed steps should not
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = step(tokens)
        elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
        if i < s["warmup"]:
            warmup_times.append(elapsed)
        else:
            times.append(elapsed)
            # CPU time of every thread of this rank (compute and Gloo): unlike wall time, it
            # hardly grows when other processes compete for the cores.
            cpu_times.append(elapsed_cpu)
        losses.append(loss.item())
    load_after = os.getloadavg()
    graphs_in_timed_steps = graphs_compiled() - graphs_before if compiled else None

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
                threads=torch.get_num_threads(), extras=step.extras(), warmup_step_seconds=warmup_times,
                graphs_in_timed_steps=graphs_in_timed_steps)


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


def _stages_parser():
    p = build_parser(__doc__, CONFIGS)
    p.add_argument("--compile", action="store_true",
                   help="also run the compiled twin (torch.compile, inductor) of every chosen config of "
                        + ", ".join(COMPILABLE) + "; the warm-up steps compile")
    p.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed's configs out (no deepspeed import)")
    return p


def parse_args(p=None, configs=CONFIGS, quick=(5, 2, 1)):
    """quick: (steps, warmup, rounds) of --quick."""
    p = p or _stages_parser()
    args = p.parse_args()
    if args.quick:
        args.steps, args.warmup, args.rounds = quick
    chosen = [c.strip() for c in args.configs.split(",") if c.strip()]
    twins = [c + COMPILED for c in configs if c in COMPILABLE]
    unknown = sorted(set(chosen) - set(configs) - set(twins))
    if unknown:
        p.error(f"unknown configs {unknown}; choose from {', '.join(configs + tuple(twins))}")
    if getattr(args, "compile", False):
        chosen += [c + COMPILED for c in chosen if c in COMPILABLE and c + COMPILED not in chosen]
    if any(c.endswith(COMPILED) for c in chosen) and args.warmup < 1:
        p.error("compiled configs need --warmup 1 or more: their first step compiles, and is not to be timed")
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


def run_spawned(args, s, failed):
    """One fresh group of processes per config and round, so each peak RSS belongs to one
    config (ranks.run_ranks: one torch thread per rank, joined in a Gloo group). A DeepSpeed
    config that fails is left out of the rest of the run, its error in failed[name]; any other
    config's failure ends the run."""
    rounds = {name: [] for name in args.configs}
    for r, order in enumerate(_round_orders(args)):
        for name in order:
            if name in failed:
                continue
            t0 = time.perf_counter()
            try:
                ranks = run_ranks(run_config, args.world_size, name, s, timeout=args.timeout)
            except Exception as e:  # noqa: BLE001  (the peer's failure, reported, not ours)
                if name not in DEEPSPEED_CONFIGS:
                    raise
                lines = str(e).strip().splitlines()
                failed[name] = f"failed in round {r + 1}: {type(e).__name__}: {lines[-1] if lines else ''}"
                print(f"  round {r + 1}/{args.rounds} {name}: {failed[name]}", flush=True)
                continue
            rounds[name].append(ranks)
            wall = statistics.median(max(x["step_seconds"][i] for x in ranks) for i in range(s["steps"]))
            print(f"  round {r + 1}/{args.rounds} {name}: {1000 * wall:.1f} ms/step, last loss "
                  f"{statistics.fmean(x['losses'][-1] for x in ranks):.4f}, load {ranks[0]['load_average'][1]:.1f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return {name: summarize(name, rounds[name], fresh_processes=True) for name in args.configs if name not in failed}


def run_torchrun(args, s):
    """Under torchrun the same processes run every config in turn: peak RSS is cumulative, so
    it is not reported per config. start() joined the group."""
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


def _deepspeed_left_out(args, under_torchrun):
    """(DeepSpeed's version or None, why its chosen configs cannot run or None). Under torchrun
    rank 0 alone imports it first (deepspeed_steps: Note [DeepSpeed's shm op])."""
    if not any(c in DEEPSPEED_CONFIGS for c in args.configs):
        return None, None
    if getattr(args, "no_deepspeed", False):
        return None, "left out (--no-deepspeed)"
    if not under_torchrun:
        return deepspeed_unavailable()
    answer = [deepspeed_unavailable() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(answer, src=0)
    return answer[0]


def start(args):
    """Settings, model size and launcher; prints the run's header on the leader. Configs that
    cannot run (DeepSpeed's, where it does not import; or one that failed) are left out of
    args.configs; the run's "left_out" says why."""
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
    if under_torchrun:
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    deepspeed_version, why = _deepspeed_left_out(args, under_torchrun)
    left_out = {name: why for name in args.configs if why and name in DEEPSPEED_CONFIGS}
    args.configs = [c for c in args.configs if c not in left_out]
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
        if deepspeed_version:
            print(f"DeepSpeed {deepspeed_version} on CPU (DS_ACCELERATOR=cpu), the same recipe by its keys "
                  "(deepspeed_steps.py); its model state is not measured", flush=True)
        if left_out:
            print(f"DeepSpeed configs left out: {why}", flush=True)
        if any(c.endswith(COMPILED) for c in args.configs):
            print(f"compiled configs: torch.compile (inductor) compiles in the first of the {s['warmup']} "
                  "warm-up steps, which are not timed", flush=True)
    failed = {}
    results = run_torchrun(args, s) if under_torchrun else run_spawned(args, s, failed)
    left_out.update(failed)
    args.configs = [c for c in args.configs if c in results]
    if leader:
        threads = sorted({r["threads"] for r in results.values()})
        print(f"torch threads per rank, as measured inside the ranks: {threads}")
        print()
    return dict(results=results, settings=s, num_params=num_params, kept=kept, world=world, leader=leader,
                launcher="torchrun" if under_torchrun else "spawn", left_out=left_out,
                deepspeed_version=deepspeed_version)


def write_json(path, run, problems, warnings):
    raw = dict(torch=torch.__version__, world_size=run["world"], threads_per_rank=1, cpus=os.cpu_count(),
               launcher=run["launcher"], num_params=run["num_params"], settings=run["settings"],
               results=run["results"], left_out=run.get("left_out", {}),
               deepspeed_version=run.get("deepspeed_version"), problems=problems, warnings=warnings)
    Path(path).write_text(json.dumps(raw, indent=2))
    print(f"raw numbers: {path}")


def report_deepspeed(results, left_out, quick):
    """zeroshard against DeepSpeed at each stage both ran, and issue 33's goals; returns the
    problems (a DeepSpeed config that failed; one that did not import is only left out)."""
    pairs = [(f"zeroshard-stage{k}", f"deepspeed-stage{k}") for k in range(4)
             if f"zeroshard-stage{k}" in results and f"deepspeed-stage{k}" in results]
    if pairs:
        print("## zeroshard against DeepSpeed, stage by stage\n")
        print(render_pairs(results, pairs))
        print()
    for name, why in left_out.items():
        print(f"{name}: {why}")
    goals = [(f"zeroshard stage {k} CPU ms <= DeepSpeed stage {k}'s", f"zeroshard-stage{k}", f"deepspeed-stage{k}", 1.0)
             for k in (1, 2)] + [(f"zeroshard stage 0 CPU ms <= {STAGE0_OVER_DDP} x DDP's", "zeroshard-stage0", "ddp",
                                  STAGE0_OVER_DDP)]
    lines = []
    for what, ours, theirs, bound in goals:
        if ours in results and theirs in results:
            ratio = results[ours]["cpu_ms_median"] / results[theirs]["cpu_ms_median"]
            lines.append(f"- goal {'met' if ratio <= bound else 'MISSED'}: {what}: {ratio:.3f}")
    if lines:
        print("Issue 33's goals (medians of CPU ms per step; a benchmark, not a check)"
              + (": --quick, a smoke run, so not a measurement" if quick else "") + "\n")
        print("\n".join(lines))
    if pairs or left_out or lines:
        print()
    return [f"{name}: {why}" for name, why in left_out.items() if why.startswith("failed")]


def report_compiled(results, configs):
    """Compiled configs against their eager twins; returns warnings (a timed step that compiled)."""
    pairs = [(c[:-len(COMPILED)], c) for c in configs if c.endswith(COMPILED) and c[:-len(COMPILED)] in results]
    if not pairs:
        return []
    print("## Compiled (torch.compile, inductor) against eager\n")
    print(render_compiled(results, pairs))
    print("\nThe first warm-up step compiles (its time is in the first column); the timed steps come after "
          "the warm-up. Every config's row is also in the tables against DDP above.\n")
    return [f"{c}: dynamo compiled {results[c]['graphs_in_timed_steps']} graph(s) during the timed steps: "
            "their times include compilation (more --warmup)" for _, c in pairs
            if results[c].get("graphs_in_timed_steps")]


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
    peer_problems = report_deepspeed(results, run["left_out"], args.quick)
    compile_warnings = report_compiled(results, configs)
    print("## Model-state memory per rank (the rank holding most)\n")
    print(render_memory(results, configs, formulas_of(run, configs)))
    print()
    print("## Losses (mean over ranks; held-out: one fixed batch after the last step)\n")
    print(render_losses(results, configs, "ddp"))
    problems, warnings = check(results, world, os.cpu_count(), "ddp", LOSS_TOLERANCE)
    problems, warnings = peer_problems + problems, warnings + compile_warnings
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
