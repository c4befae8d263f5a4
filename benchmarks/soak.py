"""Soak: a long stage-3 run with regular checkpoints, watching every rank's memory for growth.

    python benchmarks/soak.py                     # 4 ranks on 2 cores, 2,000 steps, a save every 100
    python benchmarks/soak.py --steps 300 --save-every 50 --json out.json
    python benchmarks/soak.py --tiny              # the code path in seconds (tests/python/test_soak.py)

Not part of CI (the full run takes tens of minutes on 2 cores). What is measured: 4 spawned Gloo
ranks train a small GPT at stage 3 (fp32, every parameter sharded, each block a unit) for
--steps steps, saving a checkpoint every --save-every steps (keep_last 2), and record after every
step their resident set size (RSS, /proc/self/statm) and zeroshard's memory_stats() total. The
verdict per rank: after the warm-up (the first --warmup steps, and the first save: allocator
pools, the checkpoint's first buffers), the RSS at the end minus the RSS right after warm-up,
against --tolerance-mb; memory_stats() must not change at all. The run fails (exit 1) on growth
or on any error. See docs/reliability.md ("Soak").
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt import make_model, next_token_loss, token_batch  # noqa: E402
from ranks import run_ranks  # noqa: E402

WORLD = 4
FULL = dict(steps=2000, save_every=100, warmup=150, batch=2, seq=32,
            model=dict(vocab=128, dim=64, heads=2, hidden=256, layers=4))
TINY = dict(steps=12, save_every=4, warmup=5, batch=1, seq=8,
            model=dict(vocab=32, dim=16, heads=2, hidden=32, layers=2))
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def soak_rank(rank, world_size, s, ckpt):
    import zeroshard

    model = make_model(s["seed"], **s["model"], max_seq=s["seq"])
    config = {"train_micro_batch_size_per_gpu": s["batch"], "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "zeroshard": {"stage3_unit_classes": ["Block"], "collective_timeout_seconds": 120,
                            "checkpoint": {"keep_last": 2}}}
    engine = zeroshard.initialize(model, config)
    rss, state, losses, saves = [], [], [], 0
    for step in range(1, s["steps"] + 1):
        tokens = token_batch(s["seed"], step, rank, s["batch"], s["seq"], s["model"]["vocab"])
        loss = next_token_loss(engine(tokens[:, :-1]), tokens)
        engine.backward(loss)
        engine.step()
        if step % s["save_every"] == 0:
            engine.save_checkpoint(ckpt)
            saves += 1
        losses.append(loss.item())
        rss.append(rss_bytes())
        state.append(engine.memory_stats()["total"])
    return {"rss": rss, "state": state, "losses": losses, "saves": saves}


def verdict(ranks, s, tolerance_mb):
    """Per rank: RSS after warm-up (the later of --warmup and the first save) and at the end,
    the growth, and whether memory_stats() stayed the same; ok when every rank is flat."""
    settled = max(s["warmup"], s["save_every"]) - 1  # index of the step after which it is measured
    rows = []
    for rank, r in enumerate(ranks):
        growth = r["rss"][-1] - r["rss"][settled]
        rows.append({"rank": rank, "rss_settled_mb": r["rss"][settled] / 1e6, "rss_end_mb": r["rss"][-1] / 1e6,
                     "rss_peak_mb": max(r["rss"]) / 1e6, "growth_mb": growth / 1e6,
                     "state_constant": len(set(r["state"])) == 1, "saves": r["saves"],
                     "ok": growth <= tolerance_mb * 1e6 and len(set(r["state"])) == 1})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--steps", type=int)
    p.add_argument("--save-every", type=int)
    p.add_argument("--warmup", type=int)
    p.add_argument("--tolerance-mb", type=float, default=8.0,
                   help="RSS growth per rank allowed after warm-up (default 8 MB: allocator noise)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    s = dict(TINY if args.tiny else FULL, seed=args.seed)
    for key in ("steps", "save_every", "warmup"):
        if getattr(args, key) is not None:
            s[key] = getattr(args, key)
    if s["steps"] <= max(s["warmup"], s["save_every"]):
        p.error("--steps must be more than --warmup and --save-every")
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        ranks = run_ranks(soak_rank, WORLD, s, str(Path(tmp) / "ckpt"), timeout=24 * 3600.0)
    rows = verdict(ranks, s, args.tolerance_mb)
    report = {"settings": s, "world_size": WORLD, "seconds": time.monotonic() - began, "rows": rows,
              "ok": all(r["ok"] for r in rows), "losses_rank0": ranks[0]["losses"]}
    print(f"soak: {s['steps']} steps at stage 3 on {WORLD} Gloo ranks, a save every {s['save_every']} "
          f"({rows[0]['saves']} saves), {report['seconds']:.0f} s")
    print("| rank | RSS after warm-up MB | RSS at end MB | peak MB | growth MB | memory_stats constant | ok |")
    print("|---:|---:|---:|---:|---:|---|---|")
    for r in rows:
        print(f"| {r['rank']} | {r['rss_settled_mb']:.1f} | {r['rss_end_mb']:.1f} | {r['rss_peak_mb']:.1f} "
              f"| {r['growth_mb']:+.2f} | {'yes' if r['state_constant'] else 'no'} | {'yes' if r['ok'] else 'NO'} |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
