"""What `nvidia-smi topo -m` says about the links between the GPUs a run uses.

The matrix has a row and a column per device (GPU0.., NIC0..); a cell is "X" (itself), NV#
(a bonded set of # NVLinks) or how a PCIe path runs: PIX (at most one PCIe bridge), PXB
(several bridges), PHB (through a host bridge, the CPU), NODE (between the host bridges of one
NUMA node), SYS (across the sockets' interconnect, QPI/UPI/Infinity Fabric). parse_topo and
read_topology are pure; nvidia_smi_topo runs the tool.
"""

import re
import shutil
import subprocess

# Slowest last: a ring's bandwidth is that of its slowest hop.
PCIE_PATHS = {
    "PIX": "PCIe through at most one bridge",
    "PXB": "PCIe through several bridges, not the host bridge",
    "PHB": "PCIe through a host bridge (the CPU)",
    "NODE": "PCIe across the host bridges of one NUMA node",
    "SYS": "PCIe and the interconnect between NUMA nodes (QPI/UPI)",
}
_NVLINK = re.compile(r"^NV(\d+)$")
_DEVICE = re.compile(r"^(GPU|NIC)\d+$")


def parse_topo(text):
    """{"devices": ["GPU0", ...], "links": {("GPU0", "GPU1"): "NV18", ...}} from the output of
    `nvidia-smi topo -m`; ValueError if it has no GPU matrix."""
    lines = text.splitlines()
    header = next((line.split() for line in lines if line.split()[:1] == ["GPU0"] and line[:1].isspace()), None)
    if header is None:
        raise ValueError("nvidia-smi topo -m: no header line naming GPU0 in its output")
    devices = []
    for name in header:  # the device columns come first, then "CPU Affinity" and the like
        if not _DEVICE.match(name):
            break
        devices.append(name)
    links = {}
    for line in lines:
        cells = line.split()
        if cells and cells[0] in devices and not line[:1].isspace():
            for column, cell in zip(devices, cells[1:1 + len(devices)]):
                links[(cells[0], column)] = cell
    if not any(name.startswith("GPU") for name, _ in links):
        raise ValueError("nvidia-smi topo -m: a header but no GPU rows")
    return {"devices": devices, "links": links}


def gpus_in_use(local_world_size, cuda_visible_devices):
    """nvidia-smi's indices of the GPUs of local ranks 0..local_world_size-1 (rank i on CUDA
    device i), through CUDA_VISIBLE_DEVICES when it lists indices; None when it names GPUs by
    UUID or MIG instance (the matrix cannot be matched then)."""
    if cuda_visible_devices is None:
        return list(range(local_world_size))
    visible = [v.strip() for v in cuda_visible_devices.split(",") if v.strip()]
    if not all(v.isdigit() for v in visible):
        return None
    return [int(v) for v in visible[:local_world_size]]


def _describe(cell):
    nvlink = _NVLINK.match(cell)
    if nvlink:
        return f"NVLink ({nvlink.group(1)} bonded links)"
    return PCIE_PATHS.get(cell, "a path nvidia-smi's legend names")


def read_topology(matrix, gpus=None):
    """The links between each pair of `gpus` (nvidia-smi indices; None: every GPU of the matrix):
    {"gpus", "pairs": {"0-1": "NV18"}, "counts": {"NV18": 28}, "nvlink_pairs", "pcie_pairs",
    "slowest": the slowest PCIe path or None, "reading": one sentence}."""
    present = [int(d[3:]) for d in matrix["devices"] if d.startswith("GPU")]
    gpus = present if gpus is None else [g for g in gpus if g in present]
    pairs = {}
    for i, a in enumerate(gpus):
        for b in gpus[i + 1:]:
            pairs[f"{a}-{b}"] = matrix["links"].get((f"GPU{a}", f"GPU{b}"), "?")
    counts = {}
    for cell in pairs.values():
        counts[cell] = counts.get(cell, 0) + 1
    nvlink = sum(n for cell, n in counts.items() if _NVLINK.match(cell))
    pcie = [cell for cell in PCIE_PATHS if cell in counts]
    slowest = pcie[-1] if pcie else None
    out = {"gpus": gpus, "pairs": pairs, "counts": counts, "nvlink_pairs": nvlink,
           "pcie_pairs": sum(counts[cell] for cell in pcie), "slowest": slowest}
    listed = ", ".join(f"{n} {cell} ({_describe(cell)})" for cell, n in sorted(counts.items()))
    which = "GPU " + ", ".join(map(str, gpus))
    if len(gpus) < 2:
        out["reading"] = f"{which}: fewer than two GPUs, no link between them to read"
    elif nvlink == len(pairs):
        out["reading"] = (f"{which}: NVLink between every pair ({listed}): collectives stay on NVLink")
    elif nvlink == 0:
        out["reading"] = (f"{which}: no NVLink; the {len(pairs)} pairs are {listed}. A ring runs at "
                          f"its slowest hop, {slowest}: expect PCIe-class bandwidth"
                          + (" or less, through the CPUs' interconnect" if slowest == "SYS" else ""))
    else:
        out["reading"] = (f"{which}: NVLink between some pairs only ({listed}). A collective over all "
                          f"of them runs at its slowest hop, {slowest or 'not NVLink'}")
    return out


def nvidia_smi_topo(timeout=10.0):
    """(the text of `nvidia-smi topo -m`, None) when nvidia-smi is on PATH and answers in
    `timeout` seconds; (None, why not) otherwise."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return None, "nvidia-smi is not on PATH"
    try:
        done = subprocess.run([tool, "topo", "-m"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"nvidia-smi topo -m failed: {e}"
    if done.returncode != 0:
        return None, f"nvidia-smi topo -m exited {done.returncode}: {(done.stderr or done.stdout).strip()[:200]}"
    return done.stdout, None
