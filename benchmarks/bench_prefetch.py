"""Stage 3's exposed gather wait: how long the host blocks on collectives in each step, on the
benchmark GPT (benchmarks/gpt.py, whose root unit holds the embeddings, final norm and head
around the blocks, as every real model's does), at 2 and 4 Gloo ranks on CPU.

    python benchmarks/bench_prefetch.py                  # 2 and 4 ranks, 6 layers
    python benchmarks/bench_prefetch.py --json out.json  # and the raw numbers

Per rank and step it reads wall_clock_breakdown's numbers (the `zeroshard` logger's line with
steps_per_print 1): backward_ms and comm_ms (host time blocked in CommHandle::wait, in forward,
backward and step), and the step's wall time, and prints the medians over the timed steps of
rank 0; and, in each block's backward (a hook on its output's gradient, after the engine's), whether
the block before it had been gathered ahead (its storage allocated). A fingerprint of the final
weights says whether two builds computed the same numbers.
"""

import argparse
import hashlib
import json
import logging
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt import make_model, next_token_loss, token_batch  # noqa: E402
from ranks import run_ranks  # noqa: E402

LINE = re.compile(r"backward_ms=([0-9.]+).*comm_ms=([0-9.]+)")


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def run(rank, world_size, s):
    import zeroshard

    model = make_model(s["seed"], **s["model"])
    config = {"train_micro_batch_size_per_gpu": s["batch"], "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "steps_per_print": 1, "wall_clock_breakdown": True,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10_000},
              "zeroshard": {"stage3_unit_classes": ["Block"]}}
    lines = _Lines()
    logging.getLogger("zeroshard").addHandler(lines)
    logging.getLogger("zeroshard").setLevel(logging.INFO)
    engine = zeroshard.initialize(model, config)
    # In each block's backward (a hook on its output's gradient, which runs after the engine's
    # own), whether the block before it was gathered ahead already.
    ready = []
    blocks = list(model.blocks)
    for i, block in enumerate(blocks[1:], start=1):
        def on_output(_module, _args, out, i=i):
            if out.requires_grad:
                out.register_hook(lambda _g: ready.append(blocks[i - 1].attn.qkv.weight.untyped_storage().nbytes() > 0))
        block.register_forward_hook(on_output)
    times = []
    for step in range(s["warmup"] + s["steps"]):
        tokens = token_batch(s["seed"], step, rank, s["batch"], s["seq"], s["model"]["vocab"])
        start = time.perf_counter()
        loss = next_token_loss(engine(tokens[:, :-1]), tokens)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
    parsed = [tuple(float(v) for v in m.groups()) for m in map(LINE.search, lines.lines) if m]
    timed = slice(s["warmup"], None)
    digest = hashlib.sha256()
    with engine.gathered_parameters():
        for name, p in model.named_parameters():
            digest.update(name.encode())
            digest.update(p.detach().float().numpy().tobytes())
    return dict(step_ms=[t * 1e3 for t in times[timed]], backward_ms=[b for b, _ in parsed[timed]],
                comm_ms=[c for _, c in parsed[timed]], ready=ready[(s["warmup"]) * (len(blocks) - 1):],
                fingerprint=digest.hexdigest()[:16])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-sizes", default="2,4")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    s = dict(seed=0, batch=args.batch, seq=args.seq, steps=args.steps, warmup=args.warmup,
             model=dict(vocab=512, dim=256, heads=4, hidden=1024, layers=args.layers, max_seq=args.seq))
    out = {}
    print("| ranks | step ms | backward ms | comm ms (exposed wait) | blocks prefetched in backward | fingerprint |")
    print("|---|---|---|---|---|---|")
    for world in (int(w) for w in args.world_sizes.split(",")):
        ranks = run_ranks(run, world, s, timeout=600)
        r0 = ranks[0]
        med = {k: statistics.median(r0[k]) for k in ("step_ms", "backward_ms", "comm_ms")}
        print(f"| {world} | {med['step_ms']:.1f} | {med['backward_ms']:.1f} | {med['comm_ms']:.1f} | "
              f"{sum(r0['ready'])}/{len(r0['ready'])} | {r0['fingerprint']} |")
        out[world] = ranks
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
