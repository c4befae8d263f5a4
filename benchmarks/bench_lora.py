"""A peft LoRA fine-tune at 2 and 4 Gloo ranks on CPU: zeroshard stage 3 (which shards the frozen
base with its units) against FSDP2 (fully_shard on each decoder layer, then the root) and DDP
(the whole base on every rank, the reference for bytes).

    python benchmarks/bench_lora.py                        # 2 and 4 ranks, ~2-3 minutes on 2 cores
    python benchmarks/bench_lora.py --ranks 2 --steps 20 --json out.json

The model is a transformers LlamaForCausalLM built from a LlamaConfig (no download) with peft's
LoRA (r 16 on q_proj and v_proj, lora_dropout 0): a bf16 base (requires_grad=False) and fp32
adapters, trained in that precision by every setup (no mixed-precision policy, no bf16 key in
zeroshard's config: each parameter computes in its own dtype). Every setup starts from the same
weights (one seed) and sees the same batches (benchmarks/gpt.py's token_batch of (seed, step,
rank)), in fresh processes, one torch thread per rank. Per rank it measures the frozen and the
trained bytes (parameters, gradients, AdamW state), the peak RSS during training and its rise
over the RSS before the model was built, and the step time (between barriers, so each step lasts
as long as its slowest rank). benchmarks/README.md says how to read the table.
"""

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt import token_batch  # noqa: E402
from ranks import run_ranks  # noqa: E402
from steps import fused_adamw_works  # noqa: E402

SETUPS = ("zeroshard-stage3", "fsdp2", "ddp")
MB = 1e6
LOSS_TOLERANCE = 1e-3  # relative, the step-0 loss of every setup against fsdp2's: the same bf16 forward
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build_model(s):
    """The peft LoRA model every setup trains: the base in s["base_dtype"], frozen; the adapters fp32."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    m = s["model"]
    config = LlamaConfig(hidden_size=m["hidden"], intermediate_size=m["intermediate"], num_hidden_layers=m["layers"],
                         num_attention_heads=m["heads"], num_key_value_heads=m["heads"], vocab_size=m["vocab"],
                         max_position_embeddings=s["seq"], tie_word_embeddings=False)
    torch.manual_seed(s["seed"])
    base = LlamaForCausalLM(config).to(DTYPES[s["base_dtype"]])
    model = get_peft_model(base, LoraConfig(r=s["lora_rank"], lora_alpha=2 * s["lora_rank"],
                                            target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # peft creates the adapters in the base's dtype
    return model


def decoder_layers(model):
    return model.get_base_model().model.layers


def _status_bytes(field):
    """VmRSS (now) or VmHWM (the peak since start or since _reset_peak_rss) of this process."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak_rss():
    """Starts VmHWM again from the current RSS (Linux: clear_refs 5); False where that is refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _local_bytes(tensors):
    from torch.distributed.tensor import DTensor

    # A DTensor's nbytes is the global tensor's; this rank holds only its local shard.
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors if t is not None)


class ZeroshardSetup:
    def __init__(self, model, s):
        import zeroshard

        zero = {"stage": 3, "stage3_param_persistence_threshold": s["persistence_threshold"]}
        config = {"train_micro_batch_size_per_gpu": s["batch"], "gradient_accumulation_steps": 1,
                  "gradient_clipping": 0.0, "zero_optimization": zero,
                  "steps_per_print": s["warmup"] + s["steps"] + 1,  # no log line among the table's
                  "optimizer": {"type": "AdamW", "params": {**HYPER, "betas": list(HYPER["betas"])}}}
        # Units left to the engine: the children of the largest nn.ModuleList, the decoder layers.
        self.engine = zeroshard.initialize(model, config)

    def __call__(self, tokens):
        loss = self.engine(input_ids=tokens, labels=tokens).loss
        self.engine.backward(loss)
        self.engine.step()
        return loss

    def memory(self):
        m = self.engine.memory_stats()
        return dict(frozen=m["frozen"], params=m["params"], grads=m["grads"], optimizer=m["optimizer"],
                    buckets=0, gathered_peak=m["gathered_peak"])

    def info(self):
        units = self.engine.stage3_units()
        return dict(units=[dict(name=u["name"], root=u["root"], numel=u["numel"], frozen=list(u["frozen"]))
                           for u in units], plan=self.engine.plan(), memory_stats=self.engine.memory_stats(),
                    comm_stats=self.engine.comm_stats())


class TorchSetup:
    """FSDP2 or DDP with torch.optim.AdamW over the trained parameters; zero_grad first, so the
    last step's gradients are alive where memory is read."""

    def __init__(self, name, model, s):
        self.model, self.name = model, name
        if name == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            # No mixed-precision policy: the base is already bf16 and the adapters compute in fp32,
            # as under zeroshard. Frozen parameters are sharded like the others (never reduced).
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for layer in decoder_layers(model):
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.wrapped, self.ddp = model, None
        else:
            from torch.nn.parallel import DistributedDataParallel

            self.wrapped = self.ddp = DistributedDataParallel(model)
        self.trained = [p for p in model.parameters() if p.requires_grad]
        self.fused = s["fused"]
        self.optimizer = torch.optim.AdamW(self.trained, **HYPER, **({"fused": True} if self.fused else {}))

    def __call__(self, tokens):
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.wrapped(input_ids=tokens, labels=tokens).loss
        loss.backward()
        self.optimizer.step()
        return loss

    def _bucket_bytes(self):
        # DDP's gradient buckets, a second copy of the gradients (gradient_as_bucket_view=False);
        # its logging data is the only place DDP reports them (private).
        if self.ddp is None:
            return 0
        sizes = self.ddp._get_ddp_logging_data().get("bucket_sizes")
        return sum(int(x) for x in str(sizes).split(",") if x.strip()) if sizes else 0

    def memory(self):
        frozen = [p for p in self.model.parameters() if not p.requires_grad]
        state = [v for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        return dict(frozen=_local_bytes(frozen), params=_local_bytes(self.trained),
                    grads=_local_bytes(p.grad for p in self.trained), optimizer=_local_bytes(state),
                    buckets=self._bucket_bytes(), gathered_peak=None)

    def info(self):
        return dict(fused_adamw=self.fused)


def run_setup(rank, world_size, name, s):
    """Trains the LoRA model with setup `name` on this rank; returns its raw numbers."""
    # Every setup imports the same modules before its baseline, so baselines compare.
    import peft  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.nn.parallel  # noqa: F401
    import transformers  # noqa: F401

    import zeroshard  # noqa: F401

    rss_before = _status_bytes("VmRSS")
    model = build_model(s)
    setup = ZeroshardSetup(model, s) if name == "zeroshard-stage3" else TorchSetup(name, model, s)
    rss_wrapped = _status_bytes("VmRSS")
    dist.barrier()
    build_peak = _status_bytes("VmHWM")  # imports, the whole model built, then sharded or wrapped
    peak_reset = _reset_peak_rss()

    wall, cpu, losses = [], [], []
    load_before = os.getloadavg()[0]
    for i in range(s["warmup"] + s["steps"]):
        tokens = token_batch(s["seed"], i, rank, s["batch"], s["seq"] - 1, s["model"]["vocab"])
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = setup(tokens)
        dist.barrier()  # the step lasts until its slowest rank is done
        elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
        if i >= s["warmup"]:
            wall.append(elapsed)
            cpu.append(elapsed_cpu)
        losses.append(loss.item())
    peak = _status_bytes("VmHWM") if peak_reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dict(rank=rank, setup=name, step_seconds=wall, step_cpu_seconds=cpu, losses=losses,
                memory=setup.memory(), rss_before=rss_before, rss_wrapped=rss_wrapped, peak_rss=peak,
                peak_since_start_of_training=peak_reset, build_peak_rss=build_peak,
                load_average=(load_before, os.getloadavg()[0]), threads=torch.get_num_threads(), info=setup.info())


def summarize(rounds):
    """One setup at one world size, from its runs (one list of per-rank results each): the
    worst rank's bytes and peaks, the slowest rank's steps (median over every timed step of
    every run); bytes and losses from the first run (every run computes the same)."""
    ranks, every = rounds[0], [r for run in rounds for r in run]
    wall = [max(r["step_seconds"][i] for r in run) for run in rounds for i in range(len(run[0]["step_seconds"]))]
    cpu = [max(r["step_cpu_seconds"][i] for r in run) for run in rounds for i in range(len(run[0]["step_seconds"]))]
    trained = [r["memory"]["params"] + r["memory"]["grads"] + r["memory"]["optimizer"] + r["memory"]["buckets"]
               for r in ranks]
    return dict(
        frozen=max(r["memory"]["frozen"] for r in ranks), trained=max(trained),
        peak_rss=max(r["peak_rss"] for r in every), over_baseline=max(r["peak_rss"] - r["rss_before"] for r in every),
        rss_before=max(r["rss_before"] for r in every),
        step_ms=1000 * statistics.median(wall), cpu_ms=1000 * statistics.median(cpu),
        first_loss=statistics.fmean(r["losses"][0] for r in ranks),
        last_loss=statistics.fmean(r["losses"][-1] for r in ranks),
        gathered_peak=max(r["memory"]["gathered_peak"] or 0 for r in ranks),
        load_average=max(r["load_average"][1] for r in every), ranks=ranks, rounds=rounds)


def _ratio(a, b):
    return f"{a / b:.2f}" if b else "–"


def render(rows):
    """The markdown table: one row per (world size, setup), ratios against the same run's fsdp2."""
    lines = ["| ranks | setup | frozen MB / rank | × fsdp2 | × ddp | trained MB / rank | peak RSS MB "
             "| over pre-build MB | × fsdp2 | step ms (median) | × fsdp2 | CPU ms / step | × fsdp2 |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for world, setups in rows.items():
        base, ddp = setups.get("fsdp2"), setups.get("ddp")
        for name, r in setups.items():
            def vs(key, ref=base):
                return _ratio(r[key], ref[key]) if ref else "–"
            lines.append(f"| {world} | {name} | {r['frozen'] / MB:.2f} | {vs('frozen')} | {vs('frozen', ddp)} "
                         f"| {r['trained'] / MB:.3f} | {r['peak_rss'] / MB:.0f} | {r['over_baseline'] / MB:.0f} "
                         f"| {vs('over_baseline')} | {r['step_ms']:.0f} | {vs('step_ms')} | {r['cpu_ms']:.0f} "
                         f"| {vs('cpu_ms')} |")
    return "\n".join(lines)


def check(rows):
    """PROBLEM lines: a loss that is not finite, or a setup whose ranks' step-0 losses differ from
    fsdp2's (the same weights and batches: the forward of the sharded base must not change)."""
    problems = []
    for world, setups in rows.items():
        for name, r in setups.items():
            if not all(math.isfinite(x) for rank in r["ranks"] for x in rank["losses"]):
                problems.append(f"{world} ranks, {name}: a loss is not finite")
        base = setups.get("fsdp2")
        for name, r in setups.items():
            if base is None or name == "fsdp2":
                continue
            for mine, ref in zip(r["ranks"], base["ranks"]):
                a, b = mine["losses"][0], ref["losses"][0]
                if abs(a - b) > LOSS_TOLERANCE * abs(b):
                    problems.append(f"{world} ranks, rank {mine['rank']}: {name}'s step-0 loss {a:.6f} is not "
                                    f"fsdp2's {b:.6f} (tolerance {LOSS_TOLERANCE:g} relative)")
    return problems


def goals(rows):
    """Issue 30's goals, zeroshard stage 3 against FSDP2 in the same run: frozen bytes per rank no
    more than FSDP2's; step time no slower (timing: within 5% reads as equal on a shared machine)."""
    out = []
    for world, setups in rows.items():
        z, f = setups.get("zeroshard-stage3"), setups.get("fsdp2")
        if z and f:
            frozen = "met" if z["frozen"] <= f["frozen"] else "MISSED"
            speed = "met" if z["step_ms"] <= f["step_ms"] else ("within 5%" if z["step_ms"] <= 1.05 * f["step_ms"]
                                                                else "MISSED")
            out.append(f"{world} ranks: frozen bytes {z['frozen']:,} vs {f['frozen']:,} ({frozen}); step "
                       f"{z['step_ms']:.0f} vs {f['step_ms']:.0f} ms ({speed})")
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="2,4", help="world sizes to run, comma-separated (default 2,4)")
    p.add_argument("--setups", default=",".join(SETUPS), help="comma-separated subset of " + ", ".join(SETUPS))
    p.add_argument("--steps", type=int, default=8, help="timed steps per setup (default 8)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every setup this many times, in alternating order, fresh processes each (default 1)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1376)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step (default 4)")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--base-dtype", choices=tuple(DTYPES), default="bf16", help="the frozen base's dtype (default bf16)")
    p.add_argument("--persistence-threshold", type=int, default=0,
                   help="zeroshard's stage3_param_persistence_threshold (default 0: every parameter sharded, "
                        "as FSDP2 shards them; DeepSpeed's 1e5 would keep the adapters and norms whole)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one setup may take")
    p.add_argument("--json", metavar="PATH", help="write every raw number here")
    args = p.parse_args(argv)
    args.ranks = [int(w) for w in args.ranks.split(",") if w.strip()]
    args.setups = [x.strip() for x in args.setups.split(",") if x.strip()]
    unknown = sorted(set(args.setups) - set(SETUPS))
    if unknown:
        p.error(f"unknown setups {unknown}; choose from {', '.join(SETUPS)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    s = dict(seed=args.seed, steps=args.steps, warmup=args.warmup, batch=args.batch, seq=args.seq,
             rounds=args.rounds, lora_rank=args.lora_rank, base_dtype=args.base_dtype,
             persistence_threshold=args.persistence_threshold,
             fused=fused_adamw_works(),
             model=dict(hidden=args.hidden, intermediate=args.intermediate, layers=args.layers, heads=args.heads,
                        vocab=args.vocab))
    model = build_model(s)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen_bytes = sum(p.nbytes for p in frozen)
    del model
    print(f"torch {torch.__version__}, Gloo on CPU, 1 thread per rank ({os.cpu_count()} CPUs), fresh processes "
          f"per setup; load average now {os.getloadavg()[0]:.1f}")
    print(f"model: LlamaForCausalLM {s['model']}, peft LoRA r={s['lora_rank']} on q_proj,v_proj: "
          f"{sum(p.numel() for p in frozen):,} frozen {s['base_dtype']} parameters ({frozen_bytes / MB:.2f} MB whole), "
          f"{trained:,} trained fp32")
    print(f"per rank: batch {s['batch']} x {s['seq']} tokens; {s['warmup']} warm-up + {s['steps']} timed steps, "
          f"{s['rounds']} round(s); AdamW "
          f"lr {HYPER['lr']} wd {HYPER['weight_decay']}, torch fused={s['fused']}; zeroshard "
          f"stage3_param_persistence_threshold {s['persistence_threshold']}", flush=True)
    rows = {}
    for world in args.ranks:
        runs = {name: [] for name in args.setups}
        for r in range(args.rounds):
            # Alternating order (A B C, C B A, ...) spreads a drift of the machine's load over every setup.
            for name in args.setups if r % 2 == 0 else args.setups[::-1]:
                t0 = time.perf_counter()
                runs[name].append(run_ranks(run_setup, world, name, s, timeout=args.timeout))
                x = summarize(runs[name][-1:])
                print(f"  {world} ranks {name} (round {r + 1}/{args.rounds}): {x['step_ms']:.0f} ms/step, frozen "
                      f"{x['frozen'] / MB:.2f} MB/rank, step-0 loss {x['first_loss']:.6f}, "
                      f"load {x['load_average']:.1f} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
        rows[world] = {name: summarize(runs[name]) for name in args.setups}
        units = rows[world].get("zeroshard-stage3", {}).get("ranks", [{}])[0].get("info", {}).get("units")
        if units:
            print(f"  zeroshard's units at {world} ranks: {len(units) - 1} decoder layers "
                  f"({units[0]['name']}, ...) and the root", flush=True)
    print()
    print(render(rows))
    print()
    print("| ranks | setup | step-0 loss (mean over ranks) | last-step loss | zeroshard gathered peak MB |")
    print("|---:|---|---:|---:|---:|")
    for world, setups in rows.items():
        for name, r in setups.items():
            gathered = f"{r['gathered_peak'] / MB:.2f}" if name == "zeroshard-stage3" else "–"
            print(f"| {world} | {name} | {r['first_loss']:.6f} | {r['last_loss']:.6f} | {gathered} |")
    problems = check(rows)
    print()
    for line in goals(rows):
        print(f"goal: {line}")
    print("\n".join(f"PROBLEM: {p}" for p in problems) if problems else
          f"checks: all losses finite; step-0 losses equal fsdp2's within {LOSS_TOLERANCE:g} on every rank")
    # The 1-minute load average after a setup counts this benchmark's own ranks too.
    busy = [w for w, setups in rows.items()
            if max(r["load_average"] for r in setups.values()) > max(os.cpu_count(), w) + 0.75]
    if busy:
        print(f"WARNING: the machine was busy at {', '.join(map(str, busy))} ranks (1-minute load average above the "
              f"ranks or the {os.cpu_count()} CPUs): times are noisy, the CPU column less so")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(torch=torch.__version__, cpus=os.cpu_count(), settings=s,
                                                   frozen_bytes_whole=frozen_bytes, trained_numel=trained,
                                                   rows={str(w): v for w, v in rows.items()}, problems=problems),
                                              indent=1, default=str))
        print(f"raw numbers: {args.json}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
