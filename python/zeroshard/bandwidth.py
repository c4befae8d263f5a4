"""Collective bandwidth as nccl-tests defines it, and what link class a measurement looks like.

Note [nccl-tests bandwidth] (github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md):
  algbw = S / t, with S the size of the full buffer: the all-reduce buffer, the reduce-scatter
  input, the all-gather output (n times what each rank sends), t the time of one call;
  busbw = algbw * 2(n-1)/n for all-reduce, algbw * (n-1)/n for reduce-scatter and all-gather.
busbw is what each rank's link carries per second in a ring (all-reduce is a reduce-scatter then
an all-gather, hence its 2), so it compares across collectives and rank counts, and with a
link's own bandwidth. GB is 10^9 bytes, as there. On one rank busbw is 0: no link is crossed.

The pure functions here (parse_size, bus_factor, link_class) are what `python -m zeroshard
check` prints with; tests hold them to the definitions.
"""

import re
from typing import NamedTuple

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text):
    """Bytes from "4096", "4KiB", "1 MiB", "64MB" (KiB = 1024 B, KB = 1000 B); a positive whole
    number of bytes, else ValueError saying what is accepted."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size: write bytes (4096) or a number with a unit "
                         f"(4KiB, 1MiB, 1GiB; KB/MB/GB are powers of 1000)")
    value = float(match.group(1)) * _UNITS[unit]
    if value < 1 or value != int(value):
        raise ValueError(f"{text!r} is not a positive whole number of bytes")
    return int(value)


def format_size(nbytes):
    """4096 -> "4 KiB", 3 * 2**20 // 2 -> "1.5 MiB", 100 -> "100 B"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def bus_factor(collective, ranks):
    """busbw / algbw for `collective` over `ranks` ranks (Note [nccl-tests bandwidth])."""
    if collective not in COLLECTIVES:
        raise ValueError(f"bus_factor: unknown collective {collective!r}, expected one of {COLLECTIVES}")
    if ranks < 1:
        raise ValueError(f"bus_factor: {ranks} ranks, expected at least 1")
    return (2 if collective == "all_reduce" else 1) * (ranks - 1) / ranks


def bandwidths(collective, nbytes, seconds, ranks):
    """(algbw, busbw) in GB/s for one call on a full buffer of nbytes that took `seconds`."""
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * bus_factor(collective, ranks)


class LinkClass(NamedTuple):
    name: str
    floor: float  # GB/s of busbw from which a measurement is called this class
    typical: object  # GB/s of busbw nccl-tests usually shows on it (an assumption, see source), or None
    source: str


# Note [link classes]: ordered slowest first; a GPU measurement is called the fastest class whose
# floor its best busbw reaches. Each floor is about the geometric mean of the typical values of
# its class and the one below, so a measurement goes to the class it is nearest on a log scale.
# Typical values are measured busbw, below the nominal rate: NCCL's protocols cost ~20% and a
# ring over PCIe is bounded by the host's bridges and memory. PCIe x16 nominal per direction:
# 8/16/32 GT/s per lane with 128b/130b coding = 15.75/31.5/63 GB/s for PCIe 3/4/5.
GPU_LINK_CLASSES = (
    LinkClass("slower than PCIe 3 x16: a network (Ethernet), or GPUs without peer-to-peer", 0.0, 2.5,
              "NCCL over TCP sockets on 25 GbE (3.1 GB/s line rate); the same class as GPUs whose "
              "PCIe traffic is staged through host memory"),
    LinkClass("PCIe 3.0 x16", 5.0, 12.0,
              "15.75 GB/s nominal per direction; ~75% of it through NCCL (assumption)"),
    LinkClass("PCIe 4.0 x16", 17.0, 24.0,
              "31.5 GB/s nominal per direction; ~75% of it through NCCL (assumption)"),
    LinkClass("PCIe 5.0 x16", 34.0, 48.0,
              "63 GB/s nominal per direction; 8x RTX 5090 reached 28-35 GB/s, bound by the CPU "
              "and memory (NVIDIA/nccl#1639)"),
    LinkClass("NVLink, A100 class (NVLink 3: 600 GB/s nominal, both directions)", 105.0, 230.0,
              "DGX/HGX A100 all_reduce_perf busbw ~200-230 GB/s (NVIDIA/nccl-tests#149, #100)"),
    LinkClass("NVLink, H100/H200 class or faster (NVLink 4: 900 GB/s nominal, both directions)", 290.0, 370.0,
              "450 GB/s line rate per direction, ~370 GB/s busbw after protocol overhead, ~480 "
              "all-reduce with NVLink SHARP (NVIDIA/nccl-tests#212)"),
)

CPU_GLOO = LinkClass("CPU tensors over Gloo (TCP loopback on one machine, Ethernet between machines): "
                     "says nothing about the GPUs' links", 0.0, None,
                     "Gloo moves host memory through TCP sockets; run on the GPUs to see their links")


def link_class(best_busbw, backend):
    """The LinkClass a best bus bandwidth (GB/s) looks like over `backend` ("nccl" or "gloo");
    None on one rank (busbw 0: nothing crossed a link)."""
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"link_class: backend {backend!r}, expected 'nccl' or 'gloo'")
    if not best_busbw > 0:
        return None
    if backend == "gloo":
        return CPU_GLOO
    return [c for c in GPU_LINK_CLASSES if best_busbw >= c.floor][-1]
