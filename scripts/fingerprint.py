"""The numbers a change to the core must not move, for comparing two builds.

    torchrun --nproc-per-node 2 scripts/fingerprint.py OUT.pt        # with one build
    torchrun --nproc-per-node 4 scripts/fingerprint.py OUT.pt        # adds the 4-rank layouts
    python scripts/fingerprint.py --compare A.pt B.pt                  # after running both

Trains a small transformer-like model (odd parameter sizes, one frozen-free param group split
into decay / no decay) for 4 steps with gradient accumulation 2 and clipping, at stages 0-3 in
fp32, bf16 and fp16; then bf16 with zeroshard.reduce_dtype "fp32", and fp32 and bf16 with
overlap_comm off and one micro-batch per step (16-bit gradient shards); then the optimizer
offloaded to the host (offload_optimizer "cpu") at stages 1-3 in fp32, bf16 and fp16, with
the parameters offloaded too (offload_param "cpu") and the parameters alone at stage 3, and
half the optimizer offloaded (ratio 0.5) at stages 2-3. At 4 ranks only, it adds hybrid
sharding 2x2 (zeroshard.shard_group_size 2) at stages 1-3 in fp32 and bf16 and with the
optimizer offloaded, and hpZ (zero_hpz_partition_size 2) at stage 3 in fp32 and bf16 and with
both offloaded. It records every rank's final weights (fp32 master and compute dtype),
memory_stats() and comm_stats(). --compare exits non-zero unless the two files are bitwise
equal, naming the first difference. Use it around a refactor: run it with the previous
commit's build (PYTHONPATH pointing at a copy of that zeroshard package) and with the new one,
at the same world size (a file holds the runs valid at its world size only).
"""

import argparse
import os
import sys
import warnings
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

STAGES = (0, 1, 2, 3)
PRECISIONS = ("fp32", "bf16", "fp16")
STEPS, GAS, MICRO = 4, 2, 2


class Model(nn.Module):
    def __init__(self, vocab=37, dim=24, hidden=40, layers=2):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
            for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.vocab = vocab

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x))

    def loss(self, tokens):
        logits = self(tokens[:, :-1]).float()
        return F.cross_entropy(logits.reshape(-1, self.vocab), tokens[:, 1:].reshape(-1))


class Variant(NamedTuple):
    name: str
    precision: str
    gas: int = GAS
    overlap: bool = True
    zeroshard: dict = {}     # further "zeroshard" keys
    zero: dict = {}          # further "zero_optimization" keys
    stages: tuple = STAGES
    world: int | None = None  # run only at this world size (its layout needs it)


OPTIMIZER = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
PARAMS = {"offload_param": {"device": "cpu", "pin_memory": True}}
HYBRID = {"shard_group_size": 2}  # 2 shard groups of 2 at 4 ranks
HPZ = {"zero_hpz_partition_size": 2}

# The first six are the script's original runs, their names and configs unchanged; the offload
# runs follow, then the layouts that need 4 ranks.
VARIANTS = [Variant(p, p) for p in PRECISIONS] + [
    Variant("bf16 reduce fp32", "bf16", zeroshard={"reduce_dtype": "fp32"}),
    Variant("fp32 no overlap gas 1", "fp32", 1, False),
    Variant("bf16 no overlap gas 1", "bf16", 1, False),
] + [Variant(f"{p} offload optimizer", p, zero=OPTIMIZER, stages=(1, 2, 3)) for p in PRECISIONS] + [
    Variant("fp32 offload optimizer+param", "fp32", zero=OPTIMIZER | PARAMS, stages=(3,)),
    Variant("bf16 offload optimizer+param", "bf16", zero=OPTIMIZER | PARAMS, stages=(3,)),
    Variant("bf16 offload param", "bf16", zero=PARAMS, stages=(3,)),
    Variant("bf16 offload optimizer ratio 0.5", "bf16", zero={"offload_optimizer": {"device": "cpu", "ratio": 0.5}},
            stages=(2, 3)),
    Variant("fp32 hybrid 2x2", "fp32", zeroshard=HYBRID, stages=(1, 2, 3), world=4),
    Variant("bf16 hybrid 2x2", "bf16", zeroshard=HYBRID, stages=(1, 2, 3), world=4),
    Variant("bf16 hybrid 2x2 offload optimizer", "bf16", zeroshard=HYBRID, zero=OPTIMIZER, stages=(1, 2, 3), world=4),
    Variant("fp32 hpZ 2", "fp32", zero=HPZ, stages=(3,), world=4),
    Variant("bf16 hpZ 2", "bf16", zero=HPZ, stages=(3,), world=4),
    Variant("bf16 hpZ 2 offload optimizer+param", "bf16", zero=HPZ | OPTIMIZER | PARAMS, stages=(3,), world=4),
]


def _config(stage, variant):
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": variant.gas,
        "gradient_clipping": 0.05,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.05}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 700, "overlap_comm": variant.overlap,
                              "stage3_param_persistence_threshold": 30, **variant.zero},
        "zeroshard": {"collective_timeout_seconds": 60, **variant.zeroshard},
    }
    if variant.precision != "fp32":
        config[variant.precision] = {"enabled": True}
    return config


def record(out_path):
    import torch.distributed as dist

    import zeroshard

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # One intra-op thread per rank, the offloaded host step's too: the ranks share this
    # machine's cores, and the engine's warning about it would repeat for every offloaded run.
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*offloaded optimizer steps on the host")
    results = {}
    for variant in VARIANTS:
        if variant.world not in (None, world):
            continue
        gas = variant.gas
        for stage in variant.stages:
            model = Model()
            decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
            no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
            engine = zeroshard.initialize(model, _config(stage, variant), param_groups=[
                {"params": decay}, {"params": no_decay, "weight_decay": 0.0}])
            for step in range(STEPS):
                tokens = torch.randint(0, 37, (MICRO * world * gas, 9), generator=torch.Generator().manual_seed(step))
                for m in range(gas):
                    start = (m * world + rank) * MICRO
                    engine.backward(model.loss(tokens[start:start + MICRO]))
                    engine.step()
            results[f"{variant.name} stage {stage}"] = {
                "weights": engine.full_state_dict(),
                "master": engine.full_state_dict(dtype=torch.float32),
                "memory_stats": engine.memory_stats(),
                "comm_stats": engine.comm_stats(),
            }
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, out_path)
        print(f"fingerprint: {len(results)} runs x {world} ranks -> {out_path}")
    dist.destroy_process_group()


def _first_difference(a, b, where):
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{where}: keys differ ({sorted(set(a) ^ set(b))})"
        for k in a:
            found = _first_difference(a[k], b[k], f"{where}/{k}")
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{where}: {len(a)} vs {len(b)} entries"
        for i, (x, y) in enumerate(zip(a, b)):
            found = _first_difference(x, y, f"{where}[{i}]")
            if found:
                return found
        return None
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return None if same else f"{where}: tensors differ"
    return None if a == b else f"{where}: {a!r} vs {b!r}"


def compare(a_path, b_path):
    a, b = torch.load(a_path, weights_only=False), torch.load(b_path, weights_only=False)
    difference = _first_difference(a, b, "")
    if difference:
        print(f"fingerprints differ: {difference}")
        return 1
    print(f"fingerprints are bitwise equal ({len(a[0])} runs x {len(a)} ranks: weights, master weights, "
          "memory_stats, comm_stats)")
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", help="where to write this build's fingerprint")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two fingerprint files")
    args = parser.parse_args()
    if args.compare:
        sys.exit(compare(*args.compare))
    if not args.out:
        parser.error("give OUT, or --compare A B")
    record(args.out)


if __name__ == "__main__":
    main()
