"""bf16 mixed precision: step time and per-rank model-state memory of zeroshard stages 0-3 with
`"bf16": {"enabled": true}` against DDP + torch.autocast(bfloat16) + fused AdamW and FSDP2 with
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16), on bench_stages.py's GPT, 2 Gloo
ranks on CPU.

    python benchmarks/bench_bf16.py                      # spawns 2 ranks per config, ~2-4 minutes
    python benchmarks/bench_bf16.py --quick              # smoke run
    torchrun --nproc-per-node 2 benchmarks/bench_bf16.py # all configs in one process pair

bf16 matrix products are far slower than fp32 on CPUs without native bf16 instructions, so the
defaults are smaller than bench_stages.py's: batch 2 x 64 tokens per rank, 3 warm-up + 8 timed
steps, 1 round; the model is the same. See benchmarks/README.md.
"""

import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_stages import build_parser, formulas_of, parse_args, start, write_json  # noqa: E402
from stage_report import check, check_memory, loss_reference, render, render_losses, render_memory  # noqa: E402
from steps import BF16_CONFIGS  # noqa: E402

REFERENCE = "ddp-autocast"
# Relative, held-out loss against ddp-autocast's. The configs round differently (bf16 LayerNorm
# and loss in zeroshard and FSDP2, fp32 ones under autocast; bf16 or fp32 gradient sums), so
# they agree to bf16's precision, not to fp32's.
LOSS_TOLERANCE = 0.02
# Model-state totals against their formula: zeroshard's padding (up to 16 x world-size elements
# per flat buffer) and torch AdamW's 4-byte step tensors are a few KB, under 0.02% here.
MEMORY_TOLERANCE = 2e-4


def main():
    parser = build_parser(__doc__, BF16_CONFIGS, steps=8, warmup=3, rounds=1, batch=2,
                          quick="1 warm-up + 2 timed steps")
    args = parse_args(parser, BF16_CONFIGS, quick=(2, 1, 1))
    began = time.perf_counter()
    run = start(args)
    if not run["leader"]:
        return 0
    results, world, configs = run["results"], run["world"], args.configs
    formulas = formulas_of(run, configs)

    print("## bf16: model-state memory per rank (the rank holding most)\n")
    print(render_memory(results, configs, formulas))
    print()
    print("## bf16: losses (mean over ranks; held-out: one fixed batch after the last step, fp32 "
          "cross-entropy of each config's logits)\n")
    print(render_losses(results, configs, REFERENCE))
    print()
    problems, warnings = check(results, world, os.cpu_count(), REFERENCE, LOSS_TOLERANCE)
    problems += check_memory(results, formulas, MEMORY_TOLERANCE)
    print("\n".join(f"PROBLEM: {p}" for p in problems) if problems else
          f"checks: all losses finite; every config's held-out loss within {LOSS_TOLERANCE:g} relative of "
          f"{loss_reference(results, REFERENCE)}'s; ranks agree; every model-state total within "
          f"{MEMORY_TOLERANCE:g} of its formula")
    for w in warnings:
        print(f"WARNING: {w}")
    print(f"bf16 run: {time.perf_counter() - began:.0f} s; load average now "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        write_json(args.json, run, problems, warnings)
    print()

    # The ratio tables come last.
    if REFERENCE in results:
        print("## bf16: against DDP + autocast(bfloat16) + AdamW\n")
        print(render(results, REFERENCE, configs))
        print()
    if "zeroshard-stage3-bf16" in results and "fsdp2-bf16" in results:
        print("## bf16: zeroshard stage 3 against FSDP2 with MixedPrecisionPolicy(bf16)\n")
        print(render(results, "fsdp2-bf16", ["zeroshard-stage3-bf16", "fsdp2-bf16"]))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
