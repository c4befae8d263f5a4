"""Checkpoint save, load and conversion: zeroshard against FSDP2 + torch.distributed.checkpoint
(DCP) and against DDP + torch.save from rank 0, on one GPT after one training step, with Gloo
ranks on CPU.

    python benchmarks/bench_checkpoint.py            # 2 ranks, ~34M-parameter GPT, a few minutes
    python benchmarks/bench_checkpoint.py --quick    # the default 5M-parameter GPT, ~1 minute

Every row saves model weights and AdamW state (exp_avg, exp_avg_sq, step): what a resumed run
needs. Measured per row: save and load wall time (the slowest rank, median of --repeats),
bytes on disk, load at 1 rank of the 2-rank checkpoint (resharding), and the conversion to one
state-dict file in a fresh process with its peak RSS. See benchmarks/README.md.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt import make_model, token_batch  # noqa: E402
from model_state import param_numel  # noqa: E402
from ranks import run_ranks  # noqa: E402
from steps import Recipe, make_step  # noqa: E402

ROWS = ("zeroshard-stage3", "fsdp2+dcp", "ddp+torch.save")
MB = 1e6


def _sizes(args):
    if args.quick:
        return dict(vocab=512, dim=256, heads=4, hidden=1024, layers=6, max_seq=128)
    return dict(vocab=8192, dim=512, heads=8, hidden=2048, layers=8, max_seq=128)


# The step each row trains through (steps.py), once, so that AdamW state exists: AdamW lr 1e-3
# with the libraries' other defaults (torch's default AdamW implementation, DDP's and zeroshard's
# bucket sizes); zeroshard stage 3 over the Blocks with matrices sharded (as bench_stages.py),
# keeping every checkpoint.
STEP_OF_ROW = {"zeroshard-stage3": "zeroshard-stage3", "fsdp2+dcp": "fsdp2", "ddp+torch.save": "ddp"}
RECIPE = Recipe(batch=2, lr=1e-3, persistence_threshold=10_000, checkpoint_keep_last=0)


class Row:
    """One setup: build (model + optimizer, one step), save(dir), load(dir)."""

    def __init__(self, name, sizes):
        self.name = name
        tokens = token_batch(0, 0, dist.get_rank(), RECIPE.batch, 64, sizes["vocab"])
        self.step = make_step(STEP_OF_ROW[name], make_model(0, **sizes), RECIPE)
        self.step(tokens)

    def save(self, path):
        if self.name == "zeroshard-stage3":
            self.step.engine.save_checkpoint(path, tag="ckpt")
        elif self.name == "fsdp2+dcp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict
            model_sd, optim_sd = get_state_dict(self.step.model, self.step.optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(path, "ckpt"))
        else:
            if dist.get_rank() == 0:
                os.makedirs(path, exist_ok=True)
                torch.save({"model": self.step.model.state_dict(), "optim": self.step.optimizer.state_dict()},
                           os.path.join(path, "ckpt.pt"))
            dist.barrier()

    def load(self, path):
        if self.name == "zeroshard-stage3":
            self.step.engine.load_checkpoint(path, tag="ckpt")
        elif self.name == "fsdp2+dcp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
            model_sd, optim_sd = get_state_dict(self.step.model, self.step.optimizer)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=os.path.join(path, "ckpt"))
            set_state_dict(self.step.model, self.step.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        else:
            state = torch.load(os.path.join(path, "ckpt.pt"), weights_only=True)  # every rank reads it all
            self.step.model.load_state_dict(state["model"])
            self.step.optimizer.load_state_dict(state["optim"])


def _timed(fn):
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _rank_main(rank, world_size, name, sizes, root, repeats, load_only):
    row = Row(name, sizes)  # ranks.run_ranks gives each rank one torch thread
    if load_only:
        return {"load_seconds": [_timed(lambda: row.load(root))]}
    saves, loads = [], []
    for i in range(repeats):
        path = os.path.join(root, f"r{i}")
        saves.append(_timed(lambda: row.save(path)))
        loads.append(_timed(lambda: row.load(path)))
        if i + 1 < repeats:
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path)
    return {"save_seconds": saves, "load_seconds": loads,
            "params": param_numel(make_model(0, **sizes))}


def _disk_bytes(path):
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


_CONVERT = {
    "zeroshard-stage3": "from zeroshard.convert import convert; convert({src!r}, {out!r}, tag='ckpt')",
    "fsdp2+dcp": "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
                 "dcp_to_torch_save({src!r} + '/ckpt', {out!r})",
}


def _convert(name, src, out):
    """Seconds and peak RSS of the conversion in a fresh interpreter, and of importing alone."""
    probe = ("import resource, time, torch, zeroshard; t0 = time.perf_counter(); {body}; "
             "print(time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
    results = []
    for body in (_CONVERT[name].format(src=src, out=out), "pass"):
        done = subprocess.run([sys.executable, "-c", probe.format(body=body)], capture_output=True, text=True,
                              timeout=900, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
        if done.returncode != 0:
            raise RuntimeError(f"{name} conversion failed:\n{done.stderr}")
        seconds, rss = done.stdout.split()[-2:]
        results.append((float(seconds), int(rss)))
    (seconds, rss), (_, baseline) = results
    return {"convert_seconds": seconds, "convert_peak_rss": rss, "import_peak_rss": baseline,
            "converted_bytes": os.path.getsize(out)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the 5M-parameter GPT of bench_stages.py")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--dir", default=None, help="where to write checkpoints (default: a temp dir)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    sizes = _sizes(args)
    root = Path(args.dir or tempfile.mkdtemp(prefix="zeroshard-bench-ckpt-"))
    report = {}
    for name in args.rows.split(","):
        path = root / name
        ranks = run_ranks(_rank_main, args.world_size, name, sizes, str(path), args.repeats, False, timeout=1200)
        r = {"params": ranks[0]["params"],
             "save_seconds": statistics.median(max(x["save_seconds"][i] for x in ranks) for i in range(args.repeats)),
             "load_seconds": statistics.median(max(x["load_seconds"][i] for x in ranks) for i in range(args.repeats)),
             "disk_bytes": _disk_bytes(path / f"r{args.repeats - 1}")}
        last = str(path / f"r{args.repeats - 1}")
        if name != "ddp+torch.save":
            r["load_1_rank_seconds"] = run_ranks(_rank_main, 1, name, sizes, last, 1, True, timeout=1200)[0]["load_seconds"][0]
            suffix = ".safetensors" if name == "zeroshard-stage3" else ".pt"
            r.update(_convert(name, last, str(root / f"{name}{suffix}")))
            if name == "zeroshard-stage3":  # the torch.save-format output too
                r.update({f"pt_{k}": v for k, v in _convert(name, last, str(root / f"{name}.pt")).items()})
        report[name] = r
        print(f"{name}: " + ", ".join(f"{k} {v:.3g}" for k, v in r.items()), flush=True)
        shutil.rmtree(path)
    shutil.rmtree(root, ignore_errors=True)

    base = report.get("fsdp2+dcp")
    print(f"\n{args.world_size} Gloo ranks on CPU, GPT of {next(iter(report.values()))['params'] / 1e6:.1f}M "
          f"parameters, weights + AdamW state; median of {args.repeats}.\n")
    print("| row | save s | load s | load at 1 rank s | on disk MB | convert s | convert peak RSS MB (import alone) |")
    print("|---|---|---|---|---|---|---|")
    for name, r in report.items():
        ratio = lambda k: f" ({r[k] / base[k]:.2f}x)" if base and k in base and name != "fsdp2+dcp" else ""
        one = f"{r['load_1_rank_seconds']:.2f}{ratio('load_1_rank_seconds')}" if "load_1_rank_seconds" in r else "n/a"
        conv = f"{r['convert_seconds']:.2f}{ratio('convert_seconds')}" if "convert_seconds" in r else "n/a"
        rss = (f"{r['convert_peak_rss'] / MB:.0f} ({r['import_peak_rss'] / MB:.0f})" if "convert_peak_rss" in r
               else "n/a")
        print(f"| {name} | {r['save_seconds']:.2f}{ratio('save_seconds')} | {r['load_seconds']:.2f}"
              f"{ratio('load_seconds')} | {one} | {r['disk_bytes'] / MB:.0f} | {conv} | {rss} |")
    z = report.get("zeroshard-stage3", {})
    if "pt_convert_seconds" in z:
        print(f"\nzeroshard convert to .pt instead of .safetensors: {z['pt_convert_seconds']:.2f} s, peak RSS "
              f"{z['pt_convert_peak_rss'] / MB:.0f} MB ({z['pt_import_peak_rss'] / MB:.0f} for the imports alone).")
    print("The zeroshard convert writes the model's state dict (fp32); DCP's dcp_to_torch_save writes the "
          "whole checkpoint (model and optimizer state) into one torch.save file.")
    if args.json:
        Path(args.json).write_text(json.dumps({"sizes": sizes, "world_size": args.world_size, "rows": report}, indent=1))


if __name__ == "__main__":
    main()
