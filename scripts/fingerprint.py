"""The numbers a change to the core must not move, for comparing two builds.

    torchrun --nproc-per-node 2 scripts/fingerprint.py OUT.pt        # with one build
    python scripts/fingerprint.py --compare A.pt B.pt                  # after running both

Trains a small transformer-like model (odd parameter sizes, one frozen-free param group split
into decay / no decay) for 4 steps with gradient accumulation 2 and clipping, at stages 0-3 in
fp32, bf16 and fp16; then bf16 with zeroshard.reduce_dtype "fp32", and fp32 and bf16 with
overlap_comm off and one micro-batch per step (16-bit gradient shards); and records every rank's final weights (fp32 master and compute dtype),
memory_stats() and comm_stats(). --compare exits non-zero unless the two files are bitwise
equal, naming the first difference. Use it around a refactor: run it with the previous
commit's build (PYTHONPATH pointing at a copy of that zeroshard package) and with the new one.
"""

import argparse
import os
import sys

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


# (name, precision, gradient accumulation steps, overlap_comm, zeroshard section extras)
VARIANTS = [(p, p, GAS, True, {}) for p in PRECISIONS] + [
    ("bf16 reduce fp32", "bf16", GAS, True, {"reduce_dtype": "fp32"}),
    ("fp32 no overlap gas 1", "fp32", 1, False, {}),
    ("bf16 no overlap gas 1", "bf16", 1, False, {}),
]


def _config(stage, precision, gas, overlap, extras):
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.05,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.05}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 700, "overlap_comm": overlap,
                              "stage3_param_persistence_threshold": 30},
        "zeroshard": {"collective_timeout_seconds": 60, **extras},
    }
    if precision != "fp32":
        config[precision] = {"enabled": True}
    return config


def record(out_path):
    import torch.distributed as dist

    import zeroshard

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    results = {}
    for name, precision, gas, overlap, extras in VARIANTS:
        for stage in STAGES:
            model = Model()
            decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
            no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
            engine = zeroshard.initialize(model, _config(stage, precision, gas, overlap, extras), param_groups=[
                {"params": decay}, {"params": no_decay, "weight_decay": 0.0}])
            for step in range(STEPS):
                tokens = torch.randint(0, 37, (MICRO * world * gas, 9), generator=torch.Generator().manual_seed(step))
                for m in range(gas):
                    start = (m * world + rank) * MICRO
                    engine.backward(model.loss(tokens[start:start + MICRO]))
                    engine.step()
            results[f"{name} stage {stage}"] = {
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
