"""Hybrid sharding's and hpZ's bytes per step by level, and the communication time they project
to on two nodes, for a small GPT at stages 2 and 3: flat (one shard group of 4) against 2x2
(zeroshard.shard_group_size 2: states sharded in each pair, replicated across the pairs) and, at
stage 3, hpZ 2 (zero_hpz_partition_size 2: states sharded over all 4, a secondary shard of each
gathered unit kept in each pair for its backward gather).

    python benchmarks/bench_hybrid.py                          # 4 Gloo ranks on CPU, ~40 s on 2 cores
    python benchmarks/bench_hybrid.py --tiny                   # smoke run, ~15 s
    python benchmarks/bench_hybrid.py --link 50,200 --json out.json --markdown out.md

What is measured: every config trains --warmup + --steps steps of the GPT (fp32, every stage-3
parameter sharded: persistence threshold 0, units the blocks) on 4 spawned Gloo ranks, all
configs in the same 4 processes; after each step engine.comm_stats() is read (it describes the
last step). The table shows the last step's, and says whether every timed step on every rank
counted the same. Bytes are comm_stats()'s traffic_bytes: the full buffer of each collective,
an all-reduce counted twice (csrc/zeroshard/comm/communicator.h, Note [traffic]).

The model of two nodes (ranks 0-1 on one, 2-3 on the other):
  hybrid (2x2)  "intra" is the shard group (a node), "inter" the all-reduce across the groups,
                as comm_stats() splits them.
  hpZ (hpz2)    "intra" is the secondary groups (a node): the backward all-gathers; "inter" the
                world's collectives over both nodes: the forward all-gathers, the
                reduce-scatters and the rest, as comm_stats() splits them.
  flat          all of the step's traffic counts as inter-node. A flat collective spans both
                nodes; a ring over ranks 0-3 has hops 0-1, 1-2, 2-3, 3-0, two of them across the
                boundary, and every hop carries the same bytes, so the ring runs at the pace of
                its inter-node hops: its time is its bytes over the inter bandwidth.
  time          intra bytes / intra bandwidth + inter bytes / inter bandwidth: the bandwidth term
                only (no latency), the levels one after the other, nothing overlapped with
                compute. GB/s = 1e9 bytes/s, Gb/s = 1e9 bits/s.
The ring factor (n-1)/n of the bytes a rank actually sends is left out on both sides (3/4 for the
flat ring of 4, 1/2 for either level at 2x2 and for hpZ's intra level), which understates
hybrid's and hpZ's advantage. "secondary MB" is memory_stats()["secondary_peak"]: hpZ's
secondary shards held at once during the step, beside the states, which hpZ leaves as flat's.

Beside the table stand DeepSpeed's published ZeRO++ claim (4x less communication than ZeRO-3
across nodes, from hpZ together with int8 weights and int4 gradients) and the measured flat/2x2
and flat/hpZ ratios of inter-node bytes. zeroshard quantizes nothing, so only hpZ's part of the
claim applies to it. See benchmarks/README.md ("Hybrid sharding").
"""

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt import make_model, next_token_loss, token_batch  # noqa: E402
from ranks import run_ranks  # noqa: E402

WORLD, GROUP, HPZ = 4, 2, 2
# name: (stage, shard group size, hpZ secondary group size; None is the whole world, or no hpZ)
CONFIGS = {"stage3-flat": (3, None, None), "stage3-2x2": (3, GROUP, None), "stage3-hpz2": (3, None, HPZ),
           "stage2-flat": (2, None, None), "stage2-2x2": (2, GROUP, None)}
# name: (intra GB/s, inter Gb/s)
LINKS = {"PCIe 4.0 25 GB/s / 100 Gb/s": (25.0, 100.0), "NVLink 900 GB/s / 400 Gb/s": (900.0, 400.0)}
LEVELS = ("intra", "inter")
FULL = dict(warmup=1, steps=3, batch=1, seq=64, bucket_elems=500_000,
            model=dict(vocab=512, dim=256, heads=4, hidden=1024, layers=6))
TINY = dict(warmup=1, steps=1, batch=2, seq=16, bucket_elems=4000,
            model=dict(vocab=96, dim=32, heads=2, hidden=128, layers=2))
ZERO_PP = ("DeepSpeed's ZeRO++ (blog \"DeepSpeed ZeRO++: A leap in speed for LLM and chat model training with 4X "
           "less communication\", 2023; paper arXiv:2306.10209; deepspeed.ai/tutorials/zeropp): 4x less "
           "communication than ZeRO-3 across nodes, 3M to 0.75M per step, from hpZ (no inter-node backward "
           "all-gather) with qwZ (int8 weights) and qgZ (int4 gradients) together.")
HPZ_ALONE = ("hpZ alone removes the backward all-gather across nodes: 3M to 2M, 1.5x less. Here the root unit "
             "(embeddings, final norm, head) stays gathered from its forward to its backward, so only the "
             "blocks' backward gathers move inside the node: a little under 1.5x. zeroshard quantizes nothing: "
             "qwZ and qgZ are not implemented (zero_quantized_weights and zero_quantized_gradients are ignored "
             "keys, with a warning), so the rest of the 4x (int8 weights halve the forward gather to 0.5M, int4 "
             "gradients quarter the reduce-scatter to 0.25M, against fp16) is out of its reach.")
MB = 1e6


def _config(stage, group, hpz, s):
    zero = {"stage": stage, "reduce_bucket_size": s["bucket_elems"], "stage3_param_persistence_threshold": 0}
    if hpz is not None:
        zero["zero_hpz_partition_size"] = hpz
    extras = {"stage3_unit_classes": ["Block"]} if stage == 3 else {}
    if group is not None:
        extras["shard_group_size"] = group
    config = {"train_micro_batch_size_per_gpu": s["batch"], "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.0, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                                        "weight_decay": 0.01}}}
    if extras:
        config["zeroshard"] = extras
    return config


def train_rank(rank, world_size, s):
    """Every config in turn on this rank: comm_stats() after each step, the losses, memory_stats()."""
    import zeroshard

    out = {}
    for name, (stage, group, hpz) in CONFIGS.items():
        model = make_model(s["seed"], **s["model"], max_seq=s["seq"])
        engine = zeroshard.initialize(model, _config(stage, group, hpz, s))
        comm, losses = [], []
        for i in range(s["warmup"] + s["steps"]):
            tokens = token_batch(s["seed"], i, rank, s["batch"], s["seq"], s["model"]["vocab"])
            loss = next_token_loss(engine(tokens[:, :-1]), tokens)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            comm.append(engine.comm_stats())
        out[name] = {"comm": comm[s["warmup"]:], "losses": losses, "memory": engine.memory_stats()}
        del engine, model
    return out


def level_bytes(comm, two_levels):
    """{"intra", "inter"} traffic bytes of one step's comm_stats(): comm_stats()'s own split with
    hybrid sharding or hpZ; flat, the whole step crosses the node boundary (the module's model)."""
    if two_levels:
        return {level: comm[level]["traffic_bytes"] for level in LEVELS}
    return {"intra": 0, "inter": comm["traffic_bytes"]}


def projected_seconds(levels, intra_gbps, inter_gbitps):
    return levels["intra"] / (intra_gbps * 1e9) + levels["inter"] / (inter_gbitps * 1e9 / 8)


def summarize(ranks, links):
    rows = {}
    for name, (stage, group, hpz) in CONFIGS.items():
        steps = [step for r in ranks for step in r[name]["comm"]]
        comm = steps[-1]
        levels = level_bytes(comm, group is not None or hpz is not None)
        memory = [r[name]["memory"] for r in ranks]
        rows[name] = {"stage": stage, "shard_group_size": group or WORLD, "hpz_partition_size": hpz, "comm": comm,
                      **levels, "total_traffic_bytes": comm["traffic_bytes"], "steady": all(c == comm for c in steps),
                      "memory": memory, "losses": [r[name]["losses"] for r in ranks],
                      "secondary_peak": max(m["secondary_peak"] for m in memory),
                      "projected_ms": {link: 1000 * projected_seconds(levels, *bw) for link, bw in links.items()}}
    for name, row in rows.items():
        flat = rows[f"stage{row['stage']}-flat"]
        row["flat_inter_ratio"] = flat["inter"] / row["inter"]
    return rows


def table(rows, links):
    lines = ["| config | shard group | intra MB / step / rank | inter MB / step / rank | flat inter / this | "
             "states MB / rank | secondary MB / rank | "
             + " | ".join(f"ms / step, {link}" for link in links) + " | same every step |",
             "|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(links) + "---|"]
    for name, r in rows.items():
        states = max(m["total"] for m in r["memory"])
        lines.append(f"| {name} | {r['shard_group_size']} | {r['intra'] / MB:.2f} | {r['inter'] / MB:.2f} "
                     f"| {r['flat_inter_ratio']:.2f} | {states / MB:.2f} | {r['secondary_peak'] / MB:.2f} | "
                     + " | ".join(f"{r['projected_ms'][link]:.3f}" for link in links)
                     + f" | {'yes' if r['steady'] else '**no**'} |")
    return "\n".join(lines)


def _link(text):
    try:
        intra, inter = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--link {text!r}: expected INTRA_GBps,INTER_Gbps, e.g. 50,200")
    if intra <= 0 or inter <= 0:
        raise argparse.ArgumentTypeError(f"--link {text!r}: both bandwidths must be positive")
    return intra, inter


def run(args):
    s = dict(TINY if args.tiny else FULL, seed=args.seed)
    links = dict(LINKS)
    if args.link:
        links[f"--link {args.link[0]:g} GB/s / {args.link[1]:g} Gb/s"] = args.link
    began, load_before = time.monotonic(), os.getloadavg()[0]
    ranks = run_ranks(train_rank, WORLD, s, timeout=args.timeout)
    rows = summarize(ranks, links)
    params = sum(p.numel() for p in make_model(s["seed"], **s["model"], max_seq=s["seq"]).parameters())
    report = {"torch": torch.__version__, "cpus": os.cpu_count(), "date": datetime.date.today().isoformat(),
              "settings": s, "world_size": WORLD, "params": params, "links": links, "rows": rows,
              "seconds": time.monotonic() - began, "load_average": [load_before, os.getloadavg()[0]],
              "zero_pp_claim": ZERO_PP, "hpz_alone": HPZ_ALONE}
    ratios = ", ".join(f"stage {r['stage']} {r['flat_inter_ratio']:.2f}x" for r in rows.values()
                       if r["shard_group_size"] != WORLD)
    hpz_ratio = rows[f"stage3-hpz{HPZ}"]["flat_inter_ratio"]
    note = (f"torch {torch.__version__}, {os.cpu_count()} CPUs, {report['date']}; GPT of {params / 1e6:.2f}M "
            f"parameters in fp32 on {WORLD} Gloo ranks as 2 nodes of 2, batch {s['batch']} x {s['seq']}, the last "
            f"of {s['steps']} steps after {s['warmup']}; {report['seconds']:.0f} s in all")
    text = (f"{note}\n\n{table(rows, links)}\n\n"
            "MB = 1e6 bytes of comm_stats() traffic (an all-reduce twice). Flat: all traffic counted inter-node "
            "(a ring over both nodes runs at its inter-node hops' pace). Time: intra / intra bandwidth + inter / "
            "inter bandwidth, bandwidth term only, no overlap. States: memory_stats()['total'] between steps; "
            "secondary: memory_stats()['secondary_peak'], hpZ's secondary shards at once during the step.\n\n"
            f"Measured flat / hybrid inter-node bytes at 2x2: {ratios}.\n"
            f"Measured flat / hpZ inter-node bytes at stage 3, zero_hpz_partition_size {HPZ}: {hpz_ratio:.2f}x.\n"
            f"{ZERO_PP}\n{HPZ_ALONE}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    print("\n" + text)
    return report


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="smoke run: a tiny GPT, 1 timed step")
    p.add_argument("--link", type=_link, default=None, metavar="INTRA_GBps,INTER_Gbps",
                   help="one more bandwidth pair to project with, e.g. 50,200")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for the 4 processes")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
