"""One rank of the dead-peer test (test_dead_peer.py): trains a small model with zeroshard and,
on the victim rank, dies at a chosen point of step 2.

    python dead_peer_job.py STAGE POINT VICTIM TIMEOUT OUT_DIR   (RANK, WORLD_SIZE, MASTER_* set)

POINT: "forward" (SIGKILL in the forward of the second layer), "backward" (SIGKILL in backward,
after the last layers' gradients were final, so their buckets' reductions are under way: the
buckets hold one layer each and overlap_comm is on), "save" (the victim's file-size limit is set
to 0 before the save, so its first write of its shard kills it with SIGXFSZ, the others inside
the same save, a death at a known point without timing). The victim writes OUT_DIR/died (time.time()) just before it dies; every other
rank writes OUT_DIR/rank<N>.done if it ever gets past the step, which it must not.
"""

import os
import resource
import signal
import sys
import time
from pathlib import Path

import torch

import zeroshard

STAGE, POINT, VICTIM, TIMEOUT, OUT = (int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4]),
                                      Path(sys.argv[5]))
rank = int(os.environ["RANK"])
zeroshard.init_distributed(TIMEOUT)
world = int(os.environ["WORLD_SIZE"])


def die():
    (OUT / "died").write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
config = zeroshard.Config.from_dict({
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": STAGE, "overlap_comm": True, "reduce_bucket_size": 32 * 32 + 32,
                          "stage3_prefetch_bucket_size": 0, "stage3_param_persistence_threshold": 0},
    # At stage 3 every layer is a unit of its own, gathered as the layer runs.
    "zeroshard": {"collective_timeout_seconds": TIMEOUT, **({"stage3_unit_classes": ["Linear"]} if STAGE == 3 else {})}})
engine = zeroshard.initialize(model, config)
armed = {"on": False}
if rank == VICTIM and POINT == "forward":
    model[1].register_forward_pre_hook(lambda *_: die() if armed["on"] else None)
if rank == VICTIM and POINT == "backward":
    # Runs once the gradient of layer 1's input is known: layers 2 and 3 are done by then.
    model[1].register_full_backward_hook(lambda *_: die() if armed["on"] else None)
for step in (1, 2):
    armed["on"] = step == 2
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(step * world + rank))
    out = engine(x)
    engine.backward(out.square().mean())
    engine.step()
    if POINT == "save" and step == 2:
        if rank == VICTIM:
            (OUT / "died").write_text(repr(time.time()))
            signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; the kernel's default kills
            resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))
        engine.save_checkpoint(str(OUT / "ckpt"), client_state={"step": step})
(OUT / f"rank{rank}.done").write_text("")
