"""Initialising and loading a model larger than one process: a GPT built on the meta device,
initialised and loaded from a safetensors file at stage 3 on Gloo ranks on CPU, against the same
model built whole on every rank, and against FSDP2's meta-device recipe.

    python benchmarks/bench_init.py                                       # GPT-2 XL shape, ~1.6B
    python benchmarks/bench_init.py --dim 1024 --layers 12 --heads 16     # ~255M, fits 24 GB

Recipes (each in fresh processes, so that every peak RSS belongs to one recipe):
  zeroshard-meta    build under torch.device("meta"), zeroshard.initialize, engine.load_pretrained
  zeroshard-normal  build whole in fp32 on every rank, zeroshard.initialize, engine.load_pretrained
  fsdp2             meta build, fully_shard every block and the root, to_empty, reset_parameters,
                    AdamW + one step with zero gradients (allocates its state); rank 0 reads the
                    whole file (safetensors load_file) and set_model_state_dict broadcasts it
The file is written once (one module at a time, never the whole model in memory) and reused
while its shape, dtype and seed match. See benchmarks/README.md.
"""

import argparse
import gc
import json
import os
import resource
import struct
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt import GPT  # noqa: E402
from model_state import model_state_bytes, stage3_unit_numels  # noqa: E402
from ranks import run_ranks  # noqa: E402

RECIPES = ("zeroshard-meta", "zeroshard-normal", "fsdp2")
DTYPES = {"bf16": (torch.bfloat16, "BF16"), "fp32": (torch.float32, "F32")}
# The file's values come from another seed than the one each recipe builds with, so that a
# recipe whose load did nothing keeps values that differ from the file (verify catches it).
FILE_SEED, BUILD_SEED = 1, 0
LR, WEIGHT_DECAY = 1e-4, 0.01
MB = 1e6


def gpt_sizes(dim, layers, heads, vocab, max_seq):
    return dict(vocab=vocab, dim=dim, heads=heads, hidden=4 * dim, layers=layers, max_seq=max_seq)


def meta_gpt(sizes, seed=BUILD_SEED):
    torch.manual_seed(seed)
    with torch.device("meta"):
        return GPT(**sizes)


# -- the file ----------------------------------------------------------------------------------

def _file_metadata(sizes, precision):
    return {"zeroshard_bench_init": json.dumps({"sizes": sizes, "dtype": precision, "seed": FILE_SEED},
                                               sort_keys=True)}


def _matches(path, sizes, precision):
    from safetensors import safe_open
    try:
        with safe_open(path, framework="pt") as f:
            return f.metadata() == _file_metadata(sizes, precision)
    except Exception:  # not a safetensors file, or a torn one: written again
        return False


def write_file(path, sizes, precision):
    """Writes the GPT's state dict (torch.manual_seed(FILE_SEED), then every module's
    reset_parameters in named_modules() order: the values a normal build draws) as a safetensors
    file in `precision`, streaming one module at a time, so the writer never holds the model.
    The header is written first from the meta model's shapes (safetensors' layout: 8-byte
    little-endian header length, JSON header, then the tensors back to back)."""
    dtype, dtype_name = DTYPES[precision]
    model = meta_gpt(sizes, FILE_SEED)
    order = [(prefix, module, name) for prefix, module in model.named_modules()
             for name in module._parameters if module._parameters[name] is not None]
    header, offset = {"__metadata__": _file_metadata(sizes, precision)}, 0
    for prefix, module, name in order:
        shape = list(module._parameters[name].shape)
        end = offset + dtype.itemsize * torch.Size(shape).numel()
        header[f"{prefix}.{name}" if prefix else name] = {"dtype": dtype_name, "shape": shape,
                                                         "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for module in dict.fromkeys(module for _prefix, module, _name in order):  # each once, in order
            module.to_empty(device="cpu", recurse=False)
            module.reset_parameters()
            for p in (p for p in module._parameters.values() if p is not None):
                f.write(p.detach().to(dtype).contiguous().view(torch.uint8).numpy().data)
            module.to_empty(device="meta", recurse=False)
    os.replace(tmp, path)


def ensure_file(path, sizes, precision):
    """The file at path, written unless it already holds this shape, dtype and seed. True if
    it was written now."""
    if os.path.exists(path) and _matches(path, sizes, precision):
        return False
    write_file(path, sizes, precision)
    return True


# -- one rank ----------------------------------------------------------------------------------

def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _io():
    """/proc/self/io: rchar counts bytes returned by read syscalls (pread included, page cache or
    not); read_bytes only those fetched from the block device (0 when the file is cached)."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return {k: int(fields[k]) for k in ("rchar", "read_bytes")}


def _zeroshard_config(precision):
    # Persistence threshold 0: every parameter sharded, as FSDP2 shards them, so that each rank
    # reads exactly its shards and nothing whole.
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "bf16": {"enabled": precision == "bf16"}, "zeroshard": {"stage3_unit_classes": ["Block"]}}


class ZeroshardRecipe:
    def __init__(self, sizes, precision, meta):
        import zeroshard
        if meta:
            model = meta_gpt(sizes)
        else:
            torch.manual_seed(BUILD_SEED)
            model = GPT(**sizes)  # fp32, whole, on every rank
        self.engine = zeroshard.initialize(model, _zeroshard_config(precision))

    def load(self, path):
        self.engine.load_pretrained(path)
        stats = self.engine.last_load_stats()
        return {"bytes_read": stats["bytes_read"], "param_bytes_read": stats["param_bytes_read"]}

    def model_state_bytes(self):
        return self.engine.memory_stats()["total"]

    def full_state_dict(self):
        return self.engine.full_state_dict(rank0_only=True)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


class FSDP2Recipe:
    """FSDP2's documented recipe for a model larger than one process: fully_shard on the meta
    model (every block, then the root), to_empty on the device, reset_parameters, then a full
    state dict read on rank 0 only and broadcast by set_model_state_dict. bf16: the
    MixedPrecisionPolicy of steps.py (fp32 sharded parameters, bf16 gathers)."""

    def __init__(self, sizes, precision):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model = meta_gpt(sizes)
        kwargs = {"mesh": init_device_mesh("cpu", (dist.get_world_size(),))}
        if precision == "bf16":
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        model.to_empty(device="cpu")
        with torch.no_grad(), warnings.catch_warnings():
            # "DTensor random operators may not have complete support on cpu device mesh": each
            # shard draws from the local generator; the values are overwritten by the load.
            warnings.filterwarnings("ignore", "DTensor random operators")
            for module in model.modules():
                if callable(getattr(module, "reset_parameters", None)):
                    module.reset_parameters()
        # torch's AdamW allocates its state in the first step: one step with zero gradients
        # allocates exp_avg and exp_avg_sq (the gradients stay, as after a backward). It moves
        # the weights by weight decay only, and the load below overwrites them.
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        self.optimizer.step()
        self.model = model

    def load(self, path):
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full = load_file(path) if dist.get_rank() == 0 else {}
        # load_file maps the file and copies every tensor out: its tensor bytes are what rank 0 read.
        read = {"bytes_read": sum(t.nbytes for t in full.values())}
        read["param_bytes_read"] = read["bytes_read"]
        set_model_state_dict(self.model, full, options=StateDictOptions(full_state_dict=True,
                                                                        broadcast_from_rank0=True))
        del full
        return read

    def model_state_bytes(self):
        params = list(self.model.parameters())
        state = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        tensors = params + [p.grad for p in params if p.grad is not None] + state
        return sum(_local(t).nbytes for t in tensors)

    def full_state_dict(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _timed(fn):
    dist.barrier()
    t0 = time.perf_counter()
    value = fn()
    dist.barrier()
    return value, time.perf_counter() - t0


def _verify(recipe, path):
    """On rank 0: the names whose loaded values differ from the file's (compared in the file's
    dtype), or that are missing. Gathers the whole model: for small shapes only."""
    full = recipe.full_state_dict()
    if dist.get_rank() != 0:
        return None
    from safetensors.torch import load_file
    expected = load_file(path)
    return sorted(k for k, v in expected.items() if k not in full or not torch.equal(full[k].to(v.dtype), v))


def rank_main(rank, world_size, name, sizes, precision, path, load, verify):
    import zeroshard  # noqa: F401  every recipe imports the same, so the baselines compare
    import safetensors.torch  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    gc.collect()
    dist.barrier()
    baseline, baseline_peak = _rss(), _peak_rss()
    build = ((lambda: ZeroshardRecipe(sizes, precision, meta=name == "zeroshard-meta")) if name != "fsdp2"
             else (lambda: FSDP2Recipe(sizes, precision)))
    recipe, init_seconds = _timed(build)
    after_init_peak = _peak_rss()
    out = {"rss_baseline": baseline, "peak_rss_baseline": baseline_peak, "init_seconds": init_seconds,
           "peak_rss_after_init": after_init_peak, "model_state_bytes": recipe.model_state_bytes()}
    if load:
        io = _io()
        read, out["load_seconds"] = _timed(lambda: recipe.load(path))
        end = _io()
        out.update(read, rchar=end["rchar"] - io["rchar"], read_bytes=end["read_bytes"] - io["read_bytes"])
    out["peak_rss"] = _peak_rss()
    if verify:
        out["mismatched"] = _verify(recipe, path) if load else None
    return out


# -- the report --------------------------------------------------------------------------------

def expected_bound(sizes, world_size, model_state):
    """"Shard plus two units": this rank's model-state bytes plus two of the largest stage-3
    unit's elements in fp32 (one materialised whole, one being read or freed)."""
    return model_state + 2 * 4 * max(stage3_unit_numels(meta_gpt(sizes), world_size))


def summarise(ranks, sizes, world_size, precision, file_bytes):
    """One row: every per-rank number's max over ranks, and the per-rank lists."""
    units = stage3_unit_numels(meta_gpt(sizes), world_size)
    row = {k: max(r[k] for r in ranks) for k in ("peak_rss", "init_seconds", "model_state_bytes")}
    row["over_baseline"] = max(r["peak_rss"] - r["rss_baseline"] for r in ranks)
    row["init_over_baseline"] = max(r["peak_rss_after_init"] - r["rss_baseline"] for r in ranks)
    row["rss_baseline"] = max(r["rss_baseline"] for r in ranks)
    row["bound"] = max(expected_bound(sizes, world_size, r["model_state_bytes"]) for r in ranks)
    row["formula_bytes"] = sum(model_state_bytes(3, world_size, sum(units), precision).values())
    if "load_seconds" in ranks[0]:
        row.update(load_seconds=max(r["load_seconds"] for r in ranks),
                   bytes_read_max=max(r["bytes_read"] for r in ranks),
                   bytes_read_total=sum(r["bytes_read"] for r in ranks), file_bytes=file_bytes)
    row["ranks"] = ranks
    return row


def print_table(rows, args, params, file_bytes):
    base = rows.get("zeroshard-meta")

    def cell(name, key, scale=MB, fmt=".0f"):
        r = rows[name]
        if key not in r:
            return "n/a"
        ratio = f" ({r[key] / base[key]:.2f}x)" if base and key in base and name != "zeroshard-meta" else ""
        return f"{r[key] / scale:{fmt}}{ratio}"

    print(f"\n{args.world_size} Gloo ranks on CPU, stage 3, {args.precision}; GPT of {params / 1e6:.1f}M parameters "
          f"(dim {args.dim}, {args.layers} layers, {args.heads} heads, vocab {args.vocab}, max_seq {args.max_seq}); "
          f"file {file_bytes / MB:.0f} MB. MB = 1e6 bytes; per-rank columns: the max over ranks.\n")
    print("| recipe | peak RSS / rank MB | over baseline MB | init over baseline MB | shard + two units MB "
          "| model state MB | init s | load s | read / rank MB | read in all / file |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        total = f"{r['bytes_read_total'] / r['file_bytes']:.3f}" if "bytes_read_total" in r else "n/a"
        under = "under" if r["over_baseline"] <= r["bound"] else "over"
        print(f"| {name} | {cell(name, 'peak_rss')} | {cell(name, 'over_baseline')} "
              f"| {cell(name, 'init_over_baseline')} | {r['bound'] / MB:.0f} ({under}) "
              f"| {r['model_state_bytes'] / MB:.0f} | {cell(name, 'init_seconds', 1, '.2f')} "
              f"| {cell(name, 'load_seconds', 1, '.2f')} | {cell(name, 'bytes_read_max')} | {total} |")
    print(f"\nbaseline: RSS after importing torch and zeroshard, right before building (max "
          f"{max(r['rss_baseline'] for r in rows.values()) / MB:.0f} MB). Model state at stage 3 by the formula "
          f"(model_state.py): {next(iter(rows.values()))['formula_bytes'] / MB:.0f} MB per rank. Bytes read: "
          "zeroshard from last_load_stats()['bytes_read'] (headers included); fsdp2 the tensor bytes rank 0's "
          "load_file copied out of the mapped file (other ranks read nothing; rank 0 broadcasts).")
    if "fsdp2" in rows:
        print("fsdp2 model state: fp32 parameter shards, fp32 gradient shards (zeros, kept from the step that "
              "allocated AdamW's state) and exp_avg/exp_avg_sq" + (
                  "; zeroshard's in bf16: bf16 parameter and gradient shards, fp32 master, exp_avg, exp_avg_sq."
                  if args.precision == "bf16" else "; zeroshard's the same."))


def run(args):
    sizes = gpt_sizes(args.dim, args.layers, args.heads, args.vocab, args.max_seq)
    path = args.file or (f"/tmp/zeroshard-bench-init-d{args.dim}-l{args.layers}-h{args.heads}-v{args.vocab}"
                         f"-s{args.max_seq}-{args.precision}.safetensors")
    load = not args.init_only
    if load:
        t0 = time.perf_counter()
        if ensure_file(path, sizes, args.precision):
            print(f"wrote {path} in {time.perf_counter() - t0:.1f} s", flush=True)
        else:
            print(f"reusing {path}", flush=True)
    file_bytes = os.path.getsize(path) if load else None
    rows = {}
    for name in args.recipes.split(","):
        if name not in RECIPES:
            raise SystemExit(f"bench_init.py: unknown recipe {name!r}; choose from {', '.join(RECIPES)}")
        ranks = run_ranks(rank_main, args.world_size, name, sizes, args.precision, path, load, args.verify,
                          timeout=args.timeout)
        rows[name] = summarise(ranks, sizes, args.world_size, args.precision, file_bytes)
        if args.verify and load and ranks[0]["mismatched"]:
            raise SystemExit(f"bench_init.py: {name} loaded values that differ from {path}: "
                             f"{', '.join(ranks[0]['mismatched'][:10])}")
        print(f"{name}: peak RSS {rows[name]['peak_rss'] / MB:.0f} MB, init {rows[name]['init_seconds']:.2f} s"
              + (f", load {rows[name]['load_seconds']:.2f} s" if load else ""), flush=True)
    params = sum(p.numel() for p in meta_gpt(sizes).parameters())
    report = {"sizes": sizes, "params": params, "world_size": args.world_size, "precision": args.precision,
              "stage": 3, "file": path, "file_bytes": file_bytes, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=1600)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--heads", type=int, default=25)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--max-seq", type=int, default=1024)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--precision", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated, of " + ", ".join(RECIPES))
    p.add_argument("--file", default=None, help="the safetensors file (default: under /tmp, named by shape)")
    p.add_argument("--init-only", action="store_true", help="build and initialise only: no file, no load")
    p.add_argument("--verify", action="store_true",
                   help="after loading, compare the whole model with the file on rank 0 (small shapes)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for each recipe's ranks")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    report = run(args)
    print_table(report["rows"], args, report["params"], report["file_bytes"] or 1)


if __name__ == "__main__":
    main()
