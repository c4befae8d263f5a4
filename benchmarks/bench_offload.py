"""ZeRO-Offload on CPU: the host AdamW step's throughput against torch's and DeepSpeed's CPU
AdamW, and the step time of a small GPT with and without offload at stages 2 and 3.

    python benchmarks/bench_offload.py                     # 2^24 and 2^26 elements, then the GPT: ~2 minutes on 2 cores
    python benchmarks/bench_offload.py --tiny              # smoke run, under 30 s
    python benchmarks/bench_offload.py --json out.json --markdown out.md

Host AdamW (elements per second: N / the median of --reps timed steps after --warmup), in one
fresh process at torch.get_num_threads() threads (--threads), the same hyper-parameters, initial
values and gradients for every implementation:
  zeroshard engine.step()  a world-size-1 engine at stage 1, fp32, offload_optimizer "cpu", on a
                           model of 4 flat parameters (one bucket each) whose forward is scale x
                           their sum; timed: engine.step() after a backward (the wait for the
                           gradients' host copy, the fused AdamW on the host, the copy back into
                           the parameters and their all-gather, bucket by bucket), as it is
  ..., no offload          the same engine and step with the optimizer on the (CPU) device: what
                           the engine's step costs anyway (the all-gather, zeroing the gradients)
  torch._fused_adamw_      the ATen kernel that step calls, on the same 4 tensors, nothing else
  AdamW(fused=True)        torch.optim.AdamW(fused=True), and (foreach=True) another peer
  DeepSpeedCPUAdam         deepspeed.ops.adam's, whose C++ op is JIT-built with ninja first (within
                           --deepspeed-build-timeout seconds, ~3 minutes on 2 cores the first time,
                           cached after); --tiny only uses an op built before; a failure is
                           reported in its cells.
Step time: the GPT of bench_stages.py in bf16 (batch 1 x 64: a CPU bf16 matmul is ~20x slower
than fp32) on 2 Gloo ranks (one thread each, spawned), every config in the same pair of
processes, 2 rounds in alternating order: zeroshard stage 2 and 3 without offload, with
offload_optimizer, and stage 3 with offload_param too (stage 3: every parameter sharded,
persistence threshold 0). memory_stats() by place against
model_state.offloaded_state_bytes. See benchmarks/README.md ("Offload").
"""

import argparse
import datetime
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt import make_model, token_batch  # noqa: E402
from model_state import model_state_bytes, stage3_unit_numels  # noqa: E402
from ranks import run_ranks  # noqa: E402
from steps import Recipe, make_step, offload_formula  # noqa: E402

LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01
CHUNKS = 4
PEERS = ("zeroshard engine.step()", "zeroshard engine.step(), no offload", "torch._fused_adamw_", "AdamW(fused=True)",
         "AdamW(foreach=True)", "DeepSpeedCPUAdam")
ENGINE, ENGINE_PLAIN, KERNEL, DEEPSPEED = PEERS[0], PEERS[1], PEERS[2], PEERS[5]
# Each step-time config, and the config without offload it is compared with.
CONFIGS = {"zeroshard-stage2-bf16": None, "zeroshard-stage2-offload-bf16": "zeroshard-stage2-bf16",
           "zeroshard-stage3-bf16": None, "zeroshard-stage3-offload-bf16": "zeroshard-stage3-bf16",
           "zeroshard-stage3-offload+param-bf16": "zeroshard-stage3-bf16"}
PLACES = ("host_params", "host_grads", "host_optimizer", "device_params", "device_grads", "device_optimizer")
FULL = dict(sizes=[2**24, 2**26], warmup=2, reps=7, steps=6, step_warmup=2, rounds=2, batch=1, seq=64,
            model=dict(vocab=512, dim=256, heads=4, hidden=1024, layers=6), bucket_elems=1_500_000)
TINY = dict(sizes=[2**16], warmup=1, reps=2, steps=2, step_warmup=1, rounds=1, batch=2, seq=16,
            model=dict(vocab=96, dim=32, heads=2, hidden=128, layers=2), bucket_elems=4000)
MB = 1e6


# -- host AdamW throughput, in one process ----------------------------------------------------

class FlatChunks(torch.nn.Module):
    """Parameters in flat tensors; forward(scale) = scale x their sum, so that every gradient
    element is `scale` and the backward costs one fill per element."""

    def __init__(self, values):
        super().__init__()
        self.chunks = torch.nn.ParameterList(torch.nn.Parameter(v.clone()) for v in values)

    def forward(self, scale):
        return sum(p.sum() for p in self.chunks) * scale


def _initial(numel):
    g = torch.Generator().manual_seed(numel)
    return [torch.randn(numel // CHUNKS, generator=g) * 0.02 for _ in range(CHUNKS)]


def _grad_value(i):
    return 1.0 + 0.125 * i  # exact in fp32: every implementation sees the same gradients


def _zeroshard(numel, total, offload=True):
    import zeroshard

    model = FlatChunks(_initial(numel))
    adamw = {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY}
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": adamw},
              "zero_optimization": {"stage": 1, "reduce_bucket_size": numel // CHUNKS,
                                    "offload_optimizer": {"device": "cpu" if offload else "none", "pin_memory": True}}}
    engine = zeroshard.initialize(model, config)
    seconds = []
    for i in range(total):
        engine.backward(engine(torch.tensor(_grad_value(i))))
        t0 = time.perf_counter()
        engine.step()
        seconds.append(time.perf_counter() - t0)
    master = engine.full_state_dict(dtype=torch.float32)
    final = [master[f"chunks.{k}"] for k in range(CHUNKS)]
    return seconds, final, {"memory": engine.memory_stats()}


def _kernel(numel, total):
    params = _initial(numel)
    grads, avgs, sqs = ([torch.zeros_like(p) for p in params] for _ in range(3))
    steps = [torch.zeros(()) for _ in params]
    seconds = []
    for i in range(total):
        for g in grads:
            g.fill_(_grad_value(i))
        for s in steps:
            s += 1  # torch.optim.AdamW counts the step outside the kernel too
        t0 = time.perf_counter()
        for k in range(CHUNKS):  # one call per bucket, as zeroshard's bucket-by-bucket step
            torch._fused_adamw_([params[k]], [grads[k]], [avgs[k]], [sqs[k]], [], [steps[k]], lr=LR, beta1=BETAS[0],
                                beta2=BETAS[1], weight_decay=WEIGHT_DECAY, eps=EPS, amsgrad=False, maximize=False)
        seconds.append(time.perf_counter() - t0)
    return seconds, params, {}


def _optimizer(make):
    def run(numel, total):
        params = [torch.nn.Parameter(v) for v in _initial(numel)]
        optimizer = make(params)
        seconds = []
        for i in range(total):
            for p in params:
                p.grad = torch.full_like(p, _grad_value(i))
            t0 = time.perf_counter()
            optimizer.step()
            seconds.append(time.perf_counter() - t0)
        return seconds, [p.detach() for p in params], {}
    return run


def _deepspeed_adam(params):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, adamw_mode=True)


def throughput_rank(rank, world_size, sizes, warmup, reps, threads, deepspeed_error):
    """Every implementation at every size; the kernel's final values are the reference the
    others' are compared with (max abs difference; 0.0 for the same arithmetic)."""
    os.environ["OMP_NUM_THREADS"] = str(threads)  # DeepSpeed's op runs its own OpenMP threads
    torch.set_num_threads(threads)
    runs = {ENGINE: _zeroshard, ENGINE_PLAIN: lambda numel, total: _zeroshard(numel, total, offload=False),
            KERNEL: _kernel,
            PEERS[3]: _optimizer(lambda p: torch.optim.AdamW(p, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                                             fused=True)),
            PEERS[4]: _optimizer(lambda p: torch.optim.AdamW(p, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                                             foreach=True)),
            DEEPSPEED: _optimizer(_deepspeed_adam)}
    rows = []
    for numel in sizes:
        reference = None
        for peer in (KERNEL,) + tuple(p for p in PEERS if p != KERNEL):
            row = {"peer": peer, "numel": numel, "threads": torch.get_num_threads()}
            if peer == DEEPSPEED and deepspeed_error:
                rows.append({**row, "error": deepspeed_error})
                continue
            try:
                seconds, final, extra = runs[peer](numel, warmup + reps)
            except Exception as e:  # DeepSpeed's op may still fail to load here; the others must not
                if peer != DEEPSPEED:
                    raise
                rows.append({**row, "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            timed = seconds[warmup:]
            if reference is None:
                reference = final
            diff = max((a - b).abs().max().item() for a, b in zip(final, reference))
            rows.append({**row, **extra, "seconds": timed, "median_seconds": statistics.median(timed),
                         "elements_per_second": numel / statistics.median(timed), "max_abs_diff_vs_kernel": diff})
            del final
    return rows


def deepspeed_build(timeout, build):
    """None when DeepSpeedCPUAdam's op is built (now, in a subprocess bounded by `timeout`
    seconds, or before), else why not."""
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed"
    from torch.utils.cpp_extension import _get_build_directory  # private: where the JIT build goes

    where = Path(_get_build_directory("cpu_adam", verbose=False))
    if not build:
        return None if (where / "cpu_adam.so").exists() else "not built before (--tiny builds nothing)"
    lock, locked_before = where / "lock", (where / "lock").exists()
    code = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own group: ninja and the compilers go with it
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        # torch's JIT build waits forever on the lock file of a killed build: drop ours.
        if lock.exists() and not locked_before:
            lock.unlink()
        return f"not built within {timeout:.0f} s (--deepspeed-build-timeout)"
    if proc.returncode != 0:
        last = [line for line in out.splitlines() if line.strip()][-1:] or ["no output"]
        return f"build failed (exit {proc.returncode}): {last[0][:160]}"
    return None


# -- step time with and without offload, on 2 ranks -------------------------------------------

def _recipe(s):
    return Recipe(batch=s["batch"], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                  bucket_elems=s["bucket_elems"], persistence_threshold=0)


def steps_rank(rank, world_size, s):
    """Every config, s["rounds"] times in alternating order, in this pair of processes."""
    out = {name: {"seconds": [], "cpu_seconds": [], "losses": []} for name in CONFIGS}
    names = list(CONFIGS)
    for r in range(s["rounds"]):
        for name in names if r % 2 == 0 else names[::-1]:
            model = make_model(s["seed"], **s["model"], max_seq=s["seq"])
            step = make_step(name, model, _recipe(s))
            losses = []
            for i in range(s["step_warmup"] + s["steps"]):
                tokens = token_batch(s["seed"], i, rank, s["batch"], s["seq"], s["model"]["vocab"])
                t0, c0 = time.perf_counter(), time.process_time()
                loss = step(tokens)
                if i >= s["step_warmup"]:
                    out[name]["seconds"].append(time.perf_counter() - t0)
                    out[name]["cpu_seconds"].append(time.process_time() - c0)
                losses.append(loss.item())
            out[name]["losses"].append(losses)
            out[name]["memory"] = step.engine.memory_stats()
            del step, model
    return out


def _formula(name, model, world_size, stage2_elements):
    """memory_stats()'s six places for config `name` (host_* 0 without offload)."""
    stage = int(name[len("zeroshard-stage")])
    elements = sum(stage3_unit_numels(model, world_size)) if stage == 3 else stage2_elements
    if CONFIGS[name] is not None:
        return offload_formula(name, elements, world_size)
    state = model_state_bytes(stage, world_size, elements, "bf16")
    return {**{f"host_{k}": 0 for k in state}, **{f"device_{k}": v for k, v in state.items()}}


def summarize_steps(ranks, s, world_size):
    model = make_model(s["seed"], **s["model"], max_seq=s["seq"])
    # Stage 2's buckets are padded one by one: their elements are the parameters' (whole, in bf16).
    stage2_elements = ranks[0]["zeroshard-stage2-bf16"]["memory"]["params"] // 2
    rows = {}
    for name, base in CONFIGS.items():
        wall = [max(r[name]["seconds"][i] for r in ranks) for i in range(len(ranks[0][name]["seconds"]))]
        cpu = [max(r[name]["cpu_seconds"][i] for r in ranks) for i in range(len(wall))]
        formula = _formula(name, model, world_size, stage2_elements)
        formula |= {"host_total": sum(v for k, v in formula.items() if k.startswith("host_")),
                    "device_total": sum(v for k, v in formula.items() if k.startswith("device_"))}
        memory = [r[name]["memory"] for r in ranks]
        rows[name] = {"base": base, "step_ms": [1000 * t for t in wall], "median_ms": 1000 * statistics.median(wall),
                      "cpu_median_ms": 1000 * statistics.median(cpu), "losses": [r[name]["losses"] for r in ranks],
                      "memory": memory, "formula": formula,
                      "matches_formula": all({k: m[k] for k in formula} == formula for m in memory)}
    for name, row in rows.items():
        if row["base"]:
            row["ratio"] = row["median_ms"] / rows[row["base"]]["median_ms"]
            row["losses_equal_base"] = row["losses"] == rows[row["base"]]["losses"]
    return rows


# -- the report ---------------------------------------------------------------------------------

def _size_name(n):
    return f"2^{n.bit_length() - 1}" if n & (n - 1) == 0 else f"{n:,}"


def throughput_table(rows, sizes):
    by = {(r["peer"], r["numel"]): r for r in rows}
    head = "| implementation | " + " | ".join(f"{_size_name(n)}: G elements/s (ms/step) | × DeepSpeedCPUAdam"
                                              for n in sizes) + " |"
    lines = [head, "|---|" + "---:|---:|" * len(sizes)]
    for peer in PEERS:
        cells = []
        for n in sizes:
            r, ds = by[(peer, n)], by[(DEEPSPEED, n)]
            if "error" in r:
                cells += [f"n/a: {r['error']}", ""]
                continue
            ratio = f"{r['elements_per_second'] / ds['elements_per_second']:.2f}" if "error" not in ds else "n/a"
            cells += [f"{r['elements_per_second'] / 1e9:.3f} ({1000 * r['median_seconds']:.1f})", ratio]
        lines.append(f"| {peer} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def steps_table(rows):
    lines = ["| config | step ms (median) | × no offload | CPU ms | device MB / rank | host MB / rank "
             "| = offloaded_state_bytes | losses = no offload's |", "|---|---:|---:|---:|---:|---:|---|---|"]
    for name, r in rows.items():
        mem = max(r["memory"], key=lambda m: m["total"])
        ratio = f"{r['ratio']:.2f}" if r["base"] else "–"
        same = ("bitwise" if r["losses_equal_base"] else "**differ**") if r["base"] else "–"
        lines.append(f"| {name} | {r['median_ms']:.1f} | {ratio} | {r['cpu_median_ms']:.1f} "
                     f"| {mem['device_total'] / MB:.2f} ({r['formula']['device_total'] / MB:.2f}) "
                     f"| {mem['host_total'] / MB:.2f} ({r['formula']['host_total'] / MB:.2f}) "
                     f"| {'yes' if r['matches_formula'] else '**no**'} | {same} |")
    return "\n".join(lines)


def run(args):
    s = dict(TINY if args.tiny else FULL, seed=args.seed)
    if args.sizes:
        s["sizes"] = [int(x) for x in args.sizes.split(",")]
    bad = [n for n in s["sizes"] if n % (16 * CHUNKS)]
    if bad:
        raise SystemExit(f"bench_offload.py: --sizes {bad} must be multiples of {16 * CHUNKS} (4 aligned chunks)")
    threads = args.threads or torch.get_num_threads()
    began, load_before = time.monotonic(), os.getloadavg()[0]
    deepspeed_error = ("left out (--no-deepspeed)" if args.no_deepspeed
                       else deepspeed_build(args.deepspeed_build_timeout, build=not args.tiny))
    print(f"DeepSpeedCPUAdam: {deepspeed_error or 'built'} ({time.monotonic() - began:.0f} s)", flush=True)
    throughput = run_ranks(throughput_rank, 1, s["sizes"], s["warmup"], s["reps"], threads, deepspeed_error,
                           timeout=args.timeout)[0]
    print(f"host AdamW done ({time.monotonic() - began:.0f} s)", flush=True)
    world_size = 2
    step_ranks = run_ranks(steps_rank, world_size, s, timeout=args.timeout)
    steps = summarize_steps(step_ranks, s, world_size)
    params = sum(p.numel() for p in make_model(s["seed"], **s["model"], max_seq=s["seq"]).parameters())
    report = {"torch": torch.__version__, "cpus": os.cpu_count(), "threads": threads, "settings": s,
              "date": datetime.date.today().isoformat(), "seconds": time.monotonic() - began, "params": params,
              "world_size": world_size, "deepspeed_error": deepspeed_error, "throughput": throughput, "steps": steps,
              "load_average": [load_before, os.getloadavg()[0]]}
    note = (f"torch {torch.__version__}, {os.cpu_count()} CPUs, {report['date']}; host AdamW at {threads} threads, "
            f"median of {s['reps']} steps after {s['warmup']}; GPT of {params / 1e6:.1f}M parameters in bf16 on "
            f"{world_size} Gloo ranks (1 thread each), batch {s['batch']} x {s['seq']}, median of "
            f"{s['rounds']} x {s['steps']} steps after {s['step_warmup']}; {report['seconds']:.0f} s in all; load average "
            f"{load_before:.1f} before, {report['load_average'][1]:.1f} after")
    text = (f"{note}\n\n{throughput_table(throughput, s['sizes'])}\n\n{steps_table(steps)}\n\n"
            "MB = 1e6 bytes, the rank holding most (in parentheses: model_state.offloaded_state_bytes).")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    print("\n" + text)
    return report


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="smoke run: 2^16 elements, a tiny GPT, 2 timed steps")
    p.add_argument("--sizes", default=None, help="comma-separated element counts (default 2^24,2^26)")
    p.add_argument("--threads", type=int, default=0, help="torch threads of the host AdamW (default: torch's)")
    p.add_argument("--deepspeed-build-timeout", type=float, default=300.0, help="seconds to build DeepSpeed's op")
    p.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeedCPUAdam out (no deepspeed import)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for each group of processes")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
