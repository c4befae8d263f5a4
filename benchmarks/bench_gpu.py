"""One GPU, world size 1: tokens/s and peak memory of a ~1B-parameter GPT in bf16 (sequence
2048) trained by plain single-GPU PyTorch, zeroshard stages 0-3, FSDP2 (fully_shard), zeroshard
stages 2 and 3 with ZeRO-Offload, and zeroshard stage 3 and FSDP2 with their blocks compiled
(torch.compile, inductor). The rows run in the order that decides the targets: plain,
zeroshard stage 3, FSDP2, stage 3 with its gathers on a side stream (zeroshard.stage3_gather_stream),
then the rest, the compiled rows last, so that a short --budget skips the least telling rows
first (a compiled row starts only with COMPILE_ALLOWANCE_S to spare for its compile). Each zeroshard row
states the config it runs (stage, dtype, overlap_comm, nonfinite, gather stream): no setting that
synchronises with the host hides in a default.

    python benchmarks/bench_gpu.py                          # cuda:0, 11 rows, the compiled ones as time allows
    python benchmarks/bench_gpu.py --tiny --device cpu      # the same code path on a tiny model, Gloo, CPU
    python benchmarks/bench_gpu.py --rows plain,zeroshard-stage3,fsdp2 --json out.json --markdown out.md

Every row runs in a fresh process (its own CUDA context and peak memory) from the same weights and
batches, bf16 compute with fp32 AdamW state. `plain` (the fair peer) is zeroshard's own recipe
without the engine: a bf16 model, an fp32 master copy and torch.optim.AdamW(fused=True) on it.
`plain-autocast` (only with --rows) is the usual AMP recipe. benchmarks/README.md ("GPU check")
describes every row and column.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch  # the parent process never touches the GPU: every CUDA call is in a row's process
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gpt import GPT, token_batch  # noqa: E402
from model_state import param_numel, persistent_numel  # noqa: E402
from ranks import free_port, init_group  # noqa: E402
from compiled_steps import graphs_compiled  # noqa: E402
from steps import Recipe, fused_adamw_works, make_step, offload_formula, state_formula  # noqa: E402

ROWS = ("plain", "zeroshard-stage3", "fsdp2", "zeroshard-stage3-gather-stream", "zeroshard-stage0",
        "zeroshard-stage1", "zeroshard-stage2", "zeroshard-stage2-offload", "zeroshard-stage3-offload",
        "zeroshard-stage3-compiled", "fsdp2-compiled")
OPTIONAL_ROWS = ("plain-autocast",)
GiB = 2**30
HYPER = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
FULL = dict(vocab=32768, dim=2048, heads=16, hidden=8192, layers=18, seq=2048, steps=6, warmup=2)
TINY = dict(vocab=512, dim=64, heads=4, hidden=256, layers=2, seq=64, steps=3, warmup=1, batch=4)
PERSISTENCE = 10_000  # stage 3: biases and LayerNorms (<= 8192 elements) stay gathered, matrices shard
# Seconds a compiled row needs beyond the longest row so far before it starts: inductor compiles
# one Block's forward and backward in its first warm-up step (the blocks share the graph). A
# guess, not measured on a GPU yet; on 2 CPU cores the tiny model's first compile took ~30 s.
COMPILE_ALLOWANCE_S = 120


# ---------------------------------------------------------------------------------------------
# One row, in its own process


def _sizes(s):
    return {k: s[k] for k in ("vocab", "dim", "heads", "hidden", "layers")}


# Each row's step (steps.py): bf16 compute, fp32 AdamW state.
# The offload rows: the optimizer state in host memory (offload_optimizer "cpu", pinned), at
# stage 3 the parameter shards too (offload_param), DeepSpeed's usual pairing there.
STEP_OF_ROW = {"plain": "plain-bf16", "plain-autocast": "plain-autocast", "fsdp2": "fsdp2-bf16",
               **{f"zeroshard-stage{k}": f"zeroshard-stage{k}-bf16" for k in range(4)},
               "zeroshard-stage3-gather-stream": "zeroshard-stage3-bf16",
               "zeroshard-stage2-offload": "zeroshard-stage2-offload-bf16",
               "zeroshard-stage3-offload": "zeroshard-stage3-offload+param-bf16",
               # compiled_steps.py: engine.compile(backend="inductor"); FSDP2 as torchtitan compiles it.
               "zeroshard-stage3-compiled": "zeroshard-stage3-bf16-compiled", "fsdp2-compiled": "fsdp2-bf16-compiled"}
# Keys of a row's "zeroshard" config section beyond its step's: stage 3 with its all-gathers (and
# their copy-in) issued from a side CUDA stream, as FSDP2's all-gather stream does.
ZEROSHARD_KEYS_OF_ROW = {"zeroshard-stage3-gather-stream": {"stage3_gather_stream": True}}


def _recipe(row, model, s, device):
    # DeepSpeed's default prefetch size (5e7 elements) is below one Block (5.04e7 + padding at the
    # full size), which would turn stage 3's prefetch off; two Blocks fit.
    return Recipe(batch=s["batch"], **HYPER, fused=fused_adamw_works(device), bucket_elems=s["bucket_elems"],
                  persistence_threshold=PERSISTENCE, prefetch_elems=2 * param_numel(model.blocks[0]),
                  collective_timeout_seconds=300, zeroshard_keys=ZEROSHARD_KEYS_OF_ROW.get(row))


def run_row(row, s):
    """Trains s["steps"] + s["warmup"] steps of `row`; returns its numbers."""
    device = torch.device(s["device"])
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(s["threads"])
    if row not in ("plain", "plain-autocast"):
        # A group of one, as zeroshard.init_distributed makes it: Gloo for CPU tensors, NCCL for
        # CUDA tensors.
        init_group(0, 1, free_port(), 300, "cpu:gloo,cuda:nccl" if cuda else "gloo")
    torch.manual_seed(s["seed"])
    with device:  # initialized on the device: the same weights in every row (same seed, same kernels)
        model = GPT(max_seq=s["seq"], **_sizes(s))
    num_params = param_numel(model)
    kept = persistent_numel([p.numel() for p in model.parameters()], PERSISTENCE)
    step = make_step(STEP_OF_ROW[row], model, _recipe(row, model, s, device))
    total = s["warmup"] + s["steps"]
    batches = [token_batch(s["seed"], i, 0, s["batch"], s["seq"], s["vocab"]).to(device) for i in range(total)]

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)  # the steps' peak, not construction's
    losses, started, warmup_began = [], None, time.perf_counter()
    compiled = row.endswith("-compiled")
    for i, tokens in enumerate(batches):
        if i == s["warmup"]:
            sync()
            started = time.perf_counter()
            graphs_before = graphs_compiled() if compiled else None  # the warm-up compiled
        losses.append(step(tokens).detach())
    sync()
    elapsed = time.perf_counter() - started
    memory = step.memory()
    # Model state on the device (what the peak is compared with), and zeroshard's bytes in host
    # memory (ZeRO-Offload's; 0 in the other rows, unknown for the torch rows).
    result = dict(row=row, optimizer=step.optimizer_name, num_params=num_params, kept_params=kept,
                  losses=[float(x) for x in losses], seconds=elapsed,
                  tokens_per_second=s["steps"] * s["batch"] * s["seq"] / elapsed,
                  model_state_bytes=int(memory.get("device", memory["total"])),
                  host_state_bytes=memory.get("host"), config=getattr(step, "config_summary", lambda: None)(),
                  warmup_seconds=started - warmup_began,
                  graphs_in_timed_steps=graphs_compiled() - graphs_before if compiled else None)
    if cuda:
        result.update(peak_bytes=torch.cuda.max_memory_allocated(device),
                      peak_reserved_bytes=torch.cuda.max_memory_reserved(device),
                      end_bytes=torch.cuda.memory_allocated(device))
    if dist.is_initialized():
        dist.destroy_process_group()
    return result


# ---------------------------------------------------------------------------------------------
# The parent: one process per row, then the table


def _auto_batch(s):
    """Sequences per step that fill the card with the plain row: activations of about
    (34 d L + 6 V) bytes per token in bf16 (pre-norm block with SDPA, logits and their
    log-softmax), 25% margin, next to 18 bytes per parameter (16 of model state, 2 transient)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits",
                              "-i", str(s["device_index"])], capture_output=True, text=True, timeout=30, check=True)
        total = int(out.stdout.split()[0]) * 2**20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 8, "nvidia-smi unavailable: batch 8"
    params = s["num_params"]
    per_seq = (34 * s["dim"] * s["layers"] + 6 * s["vocab"]) * s["seq"]
    batch = int((0.85 * total - 18 * params) / (1.25 * per_seq))
    batch = max(1, batch - batch % 2)
    return batch, (f"batch {batch}: {total / GiB:.0f} GiB card, ~{per_seq / GiB:.2f} GiB of activations per "
                   f"sequence (estimate), {18 * params / GiB:.0f} GiB of model state and step transients")


def _run_child(row, s, timeout):
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", row, "--worker-settings", json.dumps(s),
               "--worker-result", str(result_path)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return dict(row=row, error=f"timed out after {timeout:.0f} s")
        if proc.returncode != 0 or not result_path.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-25:]
            oom = any("OutOfMemoryError" in line or "out of memory" in line for line in tail)
            last = tail[-1].replace("|", "/")[:160] if tail else ""
            return dict(row=row, error="out of memory" if oom else f"exit {proc.returncode}: {last}",
                        log="\n".join(tail))
        return json.loads(result_path.read_text())


def _fmt(x, spec):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _size(nbytes):
    if nbytes is None:
        return "n/a"
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / 2**20:.2f} MiB"


def _config_text(config):
    gather = config["stage3_gather_stream"]
    return (f"stage {config['stage']}, {config['dtype']}, overlap_comm {str(config['overlap_comm']).lower()}, "
            f"nonfinite {config['nonfinite']}, gather stream "
            + ("n/a (no such key in this build)" if gather is None else str(gather).lower()))


def report(results, s, rows):
    """The markdown table and the targets; returns (markdown, problems)."""
    ok = {r["row"]: r for r in results if "error" not in r}
    plain = ok.get("plain")
    act = plain["peak_bytes"] - plain["model_state_bytes"] if plain and "peak_bytes" in plain else None
    lines = ["| row | tokens/s | × plain | step ms | peak memory | model state (× formula) | "
             "peak / (formula + activations) | loss first → last |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    problems, checks = [], []
    for name in rows:
        r = next((x for x in results if x["row"] == name), None)
        if r is None:
            lines.append(f"| {name} | skipped (time budget) | | | | | | |")
            continue
        if "error" in r:
            lines.append(f"| {name} | **{r['error']}** | | | | | | |")
            problems.append(f"{name}: {r['error']}")
            continue
        _, formula = state_formula(STEP_OF_ROW[name], r["num_params"], 1, r["kept_params"])
        peak = r.get("peak_bytes")
        mem_ratio = peak / (formula + act) if peak is not None and act is not None else None
        speed = r["tokens_per_second"] / plain["tokens_per_second"] if plain else None
        step_ms = 1000 * r["seconds"] / s["steps"]
        state_ratio = r["model_state_bytes"] / formula
        state = f"{_size(r['model_state_bytes'])} ({state_ratio:.4f})"
        if "offload" in name:  # and in host memory: its own formula, held the same way
            host = sum(v for k, v in offload_formula(STEP_OF_ROW[name], r["num_params"], 1, r["kept_params"]).items()
                       if k.startswith("host_"))
            host_ratio = r["host_state_bytes"] / host
            state += f" + host {_size(r['host_state_bytes'])} ({host_ratio:.4f})"
            if abs(host_ratio - 1) > 0.005:
                problems.append(f"{name}: host model state {r['host_state_bytes']:,} bytes is {host_ratio:.4f} x "
                                f"its formula ({host:,})")
        lines.append(f"| {name} | {r['tokens_per_second']:,.0f} | {_fmt(speed, '.3f')} | {step_ms:.0f} | "
                     f"{_size(peak)} | {state} | "
                     f"{_fmt(mem_ratio, '.3f')} | {r['losses'][0]:.4f} → {r['losses'][-1]:.4f} |")
        if abs(state_ratio - 1) > 0.005:  # padding and 4-byte AdamW step tensors are far below this
            problems.append(f"{name}: model state {r['model_state_bytes']:,} bytes is {state_ratio:.4f} x its "
                            f"formula ({formula:,})")
        if not all(math.isfinite(x) for x in r["losses"]):
            problems.append(f"{name}: a loss is not finite")
        if plain and abs(r["losses"][0] - plain["losses"][0]) > 0.02 * abs(plain["losses"][0]):
            problems.append(f"{name}: first loss {r['losses'][0]:.4f} differs from plain's {plain['losses'][0]:.4f} "
                            "(same weights and batch: they should agree to bf16 rounding)")
        if name.startswith("zeroshard") and mem_ratio is not None:
            checks.append((f"{name} peak within 5% of its formula + activations", mem_ratio, mem_ratio <= 1.05))
    s3, fsdp2 = ok.get("zeroshard-stage3"), ok.get("fsdp2")
    if s3 and plain:
        ratio = s3["tokens_per_second"] / plain["tokens_per_second"]
        checks.insert(0, ("stage 3 tokens/s ≥ 0.95 × plain", ratio, ratio >= 0.95))
    if s3 and fsdp2:
        ratio = s3["tokens_per_second"] / fsdp2["tokens_per_second"]
        checks.insert(1, ("stage 3 tokens/s ≥ FSDP2's (±1% is timing noise)", ratio, ratio >= 0.99))
    lines.append("")
    if act is not None:
        lines.append(f"Activations (plain's peak − its model state): {_size(act)}. {s['params_note']}")
    else:
        lines.append(s["params_note"])
    lines += [f"- target {'met' if good else 'MISSED'}: {what}: {value:.3f}" for what, value, good in checks]
    on, off = ok.get("zeroshard-stage3-gather-stream"), ok.get("zeroshard-stage3")
    if on and off:  # what the side stream buys (no target until a GPU run has checked the path)
        ratio = on["tokens_per_second"] / off["tokens_per_second"]
        lines.append(f"- zeroshard-stage3-gather-stream tokens/s: {ratio:.3f} × zeroshard-stage3's")
    for stage in (2, 3):  # what offload costs in speed (no target: that is what the row is for)
        on, off = ok.get(f"zeroshard-stage{stage}-offload"), ok.get(f"zeroshard-stage{stage}")
        if on and off:
            ratio = on["tokens_per_second"] / off["tokens_per_second"]
            lines.append(f"- zeroshard-stage{stage}-offload tokens/s: {ratio:.3f} × zeroshard-stage{stage}'s")
    for eager in ("zeroshard-stage3", "fsdp2"):  # what compiling buys (no target until a GPU run)
        on, off = ok.get(f"{eager}-compiled"), ok.get(eager)
        if on:
            text = f"- {eager}-compiled: warm-up {on['warmup_seconds']:.0f} s (its first step compiles)"
            if off:
                text += f"; tokens/s {on['tokens_per_second'] / off['tokens_per_second']:.3f} × {eager}'s"
            if on.get("graphs_in_timed_steps"):
                text += (f"; dynamo compiled {on['graphs_in_timed_steps']} graph(s) in the timed steps, so its "
                         "tokens/s counts compilation (more --warmup)")
            lines.append(text)
    on, off = ok.get("zeroshard-stage3-compiled"), ok.get("fsdp2-compiled")
    if on and off:
        lines.append(f"- zeroshard-stage3-compiled tokens/s: {on['tokens_per_second'] / off['tokens_per_second']:.3f} "
                     "× fsdp2-compiled's")
    configs = [f"- {r['row']}: {_config_text(r['config'])}" for r in results if r.get("config")]
    if configs:
        lines += ["", "zeroshard rows' configs (as the engine resolved them):"] + configs
    return "\n".join(lines), problems


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0", help="cuda:N or cpu (default cuda:0)")
    p.add_argument("--tiny", action="store_true", help="a tiny model, 1 warm-up + 3 timed steps (smoke test)")
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of " + ", ".join(ROWS + OPTIONAL_ROWS))
    p.add_argument("--batch", type=int, default=0, help="sequences per step (default: fill the card; tiny: 4)")
    for key in ("seq", "steps", "warmup", "layers", "dim", "heads", "hidden", "vocab"):
        p.add_argument(f"--{key}", type=int, default=None, help=f"default {FULL[key]} ({TINY[key]} with --tiny)")
    p.add_argument("--bucket-elems", type=int, default=50_000_000, help="zeroshard reduce_bucket_size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="torch threads on CPU")
    p.add_argument("--budget", type=float, default=300.0, help="seconds for all rows; rows that would not fit are skipped")
    p.add_argument("--json", metavar="PATH", help="write every raw number here")
    p.add_argument("--markdown", metavar="PATH", help="write the table here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-settings", help=argparse.SUPPRESS)
    p.add_argument("--worker-result", help=argparse.SUPPRESS)
    return p.parse_args()


def main():
    args = parse_args()
    if args.worker:
        result = run_row(args.worker, json.loads(args.worker_settings))
        Path(args.worker_result).write_text(json.dumps(result))
        return 0

    began = time.monotonic()
    defaults = TINY if args.tiny else FULL
    s = {k: getattr(args, k) if getattr(args, k, None) is not None else defaults[k] for k in FULL}
    s.update(device=args.device, seed=args.seed, threads=args.threads, bucket_elems=args.bucket_elems,
             device_index=int(args.device.split(":")[1]) if ":" in args.device else 0)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = sorted(set(rows) - set(ROWS + OPTIONAL_ROWS))
    if unknown:
        sys.exit(f"bench_gpu: unknown rows {unknown}; choose from {', '.join(ROWS + OPTIONAL_ROWS)}")
    if s["warmup"] < 1 and any(r.endswith("-compiled") for r in rows):
        sys.exit("bench_gpu: the compiled rows need --warmup 1 or more: their first step compiles")
    with torch.device("meta"):  # sizes without memory
        s["num_params"] = sum(p.numel() for p in GPT(max_seq=s["seq"], **_sizes(s)).parameters())
    if args.batch:
        s["batch"], batch_note = args.batch, f"batch {args.batch} (--batch)"
    elif args.tiny:
        s["batch"], batch_note = TINY["batch"], "batch 4 (--tiny)"
    elif args.device.startswith("cuda"):
        s["batch"], batch_note = _auto_batch(s)
    else:
        s["batch"], batch_note = 2, "batch 2 (CPU)"
    s["params_note"] = (f"Model: GPT {s['layers']} x {s['dim']} (heads {s['heads']}, MLP {s['hidden']}, vocab "
                        f"{s['vocab']}, sequence {s['seq']}), {s['num_params'] / 1e6:,.1f}M parameters. Model state "
                        "formula: 16 bytes per parameter (+2 per kept parameter at stage 3); offload rows: the "
                        "device's bytes, and after + those in host memory (steps.offload_formula).")
    print(f"bench_gpu: torch {torch.__version__} (CUDA {torch.version.cuda}), device {args.device}, world size 1; "
          f"{s['params_note']} {batch_note}; {s['warmup']} warm-up + {s['steps']} timed steps per row", flush=True)

    results, longest = [], 0.0
    for row in rows:
        left = args.budget - (time.monotonic() - began)
        if left < 1.2 * longest + (COMPILE_ALLOWANCE_S if row.endswith("-compiled") else 0) or left < 5:
            print(f"  {row}: skipped, {left:.0f} s of the budget left", flush=True)
            continue
        t0 = time.monotonic()
        r = _run_child(row, s, timeout=left)
        if row == "plain" and r.get("error") == "out of memory" and s["batch"] > 1 and not args.batch:
            s["batch"] //= 2  # every row runs the plain row's batch
            print(f"  plain: out of memory; retrying every row at batch {s['batch']}", flush=True)
            r = _run_child(row, s, timeout=args.budget - (time.monotonic() - began))
        longest = max(longest, time.monotonic() - t0)
        results.append(r)
        if "error" in r:
            print(f"  {row}: {r['error']} ({time.monotonic() - t0:.0f} s)\n" + r.get("log", ""), flush=True)
        else:
            print(f"  {row}: {r['tokens_per_second']:,.0f} tokens/s, peak {_size(r.get('peak_bytes'))}, losses "
                  f"{r['losses'][0]:.4f} → {r['losses'][-1]:.4f} ({time.monotonic() - t0:.0f} s)"
                  + (f"; warm-up {r['warmup_seconds']:.0f} s, with the compile" if row.endswith("-compiled") else "")
                  + (f"; {_config_text(r['config'])}" if r.get("config") else ""), flush=True)

    table, problems = report(results, s, rows)
    note = (f"torch {torch.__version__}, {args.device}, world size 1, bf16, {s['batch']} x {s['seq']} tokens per "
            f"step, {s['warmup']} warm-up + {s['steps']} timed steps; {time.monotonic() - began:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(settings=s, torch=torch.__version__, results=results,
                                                   problems=problems), indent=2))
    if args.markdown:
        Path(args.markdown).write_text(f"{note}\n\n{table}\n")
    print("\n".join(f"PROBLEM: {p}" for p in problems))
    print(f"\n## GPU check: {note}\n\n{table}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
