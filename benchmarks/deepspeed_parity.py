"""One DeepSpeed training script under DeepSpeed itself and under `zeroshard.deepspeed`.

tests/python/ds_script.py (written as a DeepSpeed user writes a script; one import differs) runs
through torchrun on 2 CPU ranks, once with DeepSpeed (DS_ACCELERATOR=cpu, Gloo, AdamW through
torch: "torch_adam": true) and once with the drop-in, at ZeRO stages 1-3, with a WarmupDecayLR
schedule (warmup_type log) and 2 accumulation steps, from the same config file. Prints per
optimizer step the losses and learning rates of both, the largest loss and weight differences,
and the mean optimizer-step wall time of each (the first step, with its start-up, left out) and
their ratio. Exits non-zero if the learning rates, boundaries or counters differ, or a weight
differs by more than --tolerance.

    python benchmarks/deepspeed_parity.py                # stages 1-3, 10 steps: ~10 minutes on 2 cores
    python benchmarks/deepspeed_parity.py --stages 2 --steps 6
"""

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, os.pardir, "tests", "python", "ds_script.py")
MICRO, GAS, LR = 2, 2, 1e-2


def config(stage, world, steps):
    return {
        "train_batch_size": MICRO * GAS * world,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.05, "torch_adam": True}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR,
                                                          "warmup_num_steps": max(2, steps // 3),
                                                          "total_num_steps": steps}},
        "zero_optimization": {"stage": stage},
    }


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(backend, config_path, steps, world, directory, timeout):
    out = os.path.join(directory, f"{backend}.pt")
    env = dict(os.environ, DS_ACCELERATOR="cpu", DS_SCRIPT_BACKEND=backend, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port",
               str(free_port()), SCRIPT, "--deepspeed_config", config_path, "--steps", str(steps), "--out", out]
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"{backend} run failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n"
                         f"{done.stderr[-6000:]}")
    record = torch.load(out)
    record["wall"] = time.perf_counter() - started
    return record


def compare(stage, theirs, ours, tolerance):
    print(f"\n== ZeRO stage {stage}: DeepSpeed vs zeroshard.deepspeed")
    print(f"{'step':>4} {'loss deepspeed':>15} {'loss zeroshard':>15} {'lr deepspeed':>13} {'lr zeroshard':>13}")
    steps = len(theirs["step_time"])
    mean = lambda r, s: sum(r["loss"][s * GAS:(s + 1) * GAS]) / GAS  # noqa: E731
    for s in range(steps):
        print(f"{s:>4} {mean(theirs, s):>15.8f} {mean(ours, s):>15.8f} {theirs['lr'][s * GAS]:>13.6g} "
              f"{ours['lr'][s * GAS]:>13.6g}")
    loss_diff = max(abs(a - b) for a, b in zip(theirs["loss"], ours["loss"]))
    weight_diff = max((theirs["weights"][k] - ours["weights"][k]).abs().max().item() for k in theirs["weights"])
    time_theirs = sum(theirs["step_time"][1:]) / max(1, steps - 1)
    time_ours = sum(ours["step_time"][1:]) / max(1, steps - 1)
    print(f"max |loss difference| {loss_diff:.3g}   max |weight difference| {weight_diff:.3g}")
    print(f"mean step time: deepspeed {time_theirs * 1e3:.1f} ms, zeroshard {time_ours * 1e3:.1f} ms, "
          f"ratio deepspeed/zeroshard {time_theirs / time_ours:.2f}  (whole run incl. start-up: "
          f"{theirs['wall']:.0f} s / {ours['wall']:.0f} s)")
    problems = []
    if [round(x, 12) for x in theirs["lr"]] != [round(x, 12) for x in ours["lr"]]:
        problems.append("learning rates differ")
    for key in ("boundary", "global_steps", "global_samples"):
        if theirs[key] != ours[key]:
            problems.append(f"{key} differs")
    if weight_diff > tolerance:
        problems.append(f"weights differ by {weight_diff:.3g} > {tolerance}")
    return dict(stage=stage, loss_diff=loss_diff, weight_diff=weight_diff, step_ms_deepspeed=time_theirs * 1e3,
                step_ms_zeroshard=time_ours * 1e3, problems=problems)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", default="1,2,3")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest weight difference accepted")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--json", default=None, help="also write the summary here")
    args = parser.parse_args()
    if importlib.util.find_spec("deepspeed") is None:
        raise SystemExit("DeepSpeed is not installed (pip install deepspeed); it runs on CPU with DS_ACCELERATOR=cpu")
    summary = []
    with tempfile.TemporaryDirectory(prefix="zeroshard-ds-parity-") as directory:
        for stage in [int(s) for s in args.stages.split(",")]:
            path = os.path.join(directory, f"stage{stage}.json")
            with open(path, "w") as f:
                json.dump(config(stage, args.world_size, args.steps), f)
            theirs = run("deepspeed", path, args.steps, args.world_size, directory, args.timeout)
            ours = run("zeroshard", path, args.steps, args.world_size, directory, args.timeout)
            summary.append(compare(stage, theirs, ours, args.tolerance))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    failed = [f"stage {s['stage']}: {p}" for s in summary for p in s["problems"]]
    print("\n" + ("FAILED: " + "; ".join(failed) if failed else "parity: every stage matches DeepSpeed"))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
