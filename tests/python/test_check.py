"""python -m zeroshard check (zeroshard/check.py, bandwidth.py, topology.py).

Held to: under torchrun on 2 ranks (Gloo on CPU) it prints one table row per collective and
size, and only rank 0 prints (one header, one table, one call of nvidia-smi); the JSON's algbw is
S / t and its busbw algbw * 2(n-1)/n for all-reduce, * (n-1)/n for reduce-scatter and all-gather
(nccl-tests), with S the full buffer; with a (fake) nvidia-smi on PATH it prints the matrix and
its reading. The link classes follow their table; the topology parser reads an 8x H100 NVLink
box, a 4x PCIe box and a mixed one. A bad flag is an error naming the flag, before any group.

One torchrun launch of 2 ranks (~10 s on 2 cores) serves the tests that read its output.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import zeroshard
from zeroshard import bandwidth, check, topology

PACKAGE_ROOT = os.path.dirname(os.path.dirname(zeroshard.__file__))
SIZES = (4096, 2**20)
RUN_TIMEOUT = 120  # seconds; the launch takes ~10

H100_8 = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tPIX\tSYS\t0-55,112-167\t0\t\tN/A
GPU1\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tSYS\tSYS\t0-55,112-167\t0\t\tN/A
GPU2\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tSYS\tSYS\t0-55,112-167\t0\t\tN/A
GPU3\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tSYS\tSYS\t0-55,112-167\t0\t\tN/A
GPU4\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tSYS\tPIX\t56-111,168-223\t1\t\tN/A
GPU5\tNV18\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tSYS\tSYS\t56-111,168-223\t1\t\tN/A
GPU6\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tSYS\tSYS\t56-111,168-223\t1\t\tN/A
GPU7\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\t X \tSYS\tSYS\t56-111,168-223\t1\t\tN/A
NIC0\tPIX\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\t X \tSYS
NIC1\tSYS\tSYS\tSYS\tSYS\tPIX\tSYS\tSYS\tSYS\tSYS\t X

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks

NIC Legend:

  NIC0: mlx5_0
  NIC1: mlx5_1
"""

PCIE_4 = """\
        GPU0    GPU1    GPU2    GPU3    CPU Affinity    NUMA Affinity   GPU NUMA ID
GPU0     X      NODE    SYS     SYS     0-15,32-47      0               N/A
GPU1    NODE     X      SYS     SYS     0-15,32-47      0               N/A
GPU2    SYS     SYS      X      NODE    16-31,48-63     1               N/A
GPU3    SYS     SYS     NODE     X      16-31,48-63     1               N/A

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
"""

# NVLink bridges between pairs of A100 PCIe cards (NVIDIA/nccl-tests#178's layout, 4 cards).
MIXED_4 = """\
        GPU0    GPU1    GPU2    GPU3    CPU Affinity    NUMA Affinity
GPU0     X      NV12    NODE    NODE    0-31,64-95      0
GPU1    NV12     X      NODE    NODE    0-31,64-95      0
GPU2    NODE    NODE     X      NV12    0-31,64-95      0
GPU3    NODE    NODE    NV12     X      0-31,64-95      0
"""


# --- the definitions and the link classes (pure) ---

@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_bus_factor_is_nccl_tests(n):
    assert bandwidth.bus_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    assert bandwidth.bus_factor("reduce_scatter", n) == pytest.approx((n - 1) / n)
    assert bandwidth.bus_factor("all_gather", n) == pytest.approx((n - 1) / n)
    algbw, busbw = bandwidth.bandwidths("all_reduce", 10**9, 0.5, n)
    assert algbw == pytest.approx(2.0) and busbw == pytest.approx(2.0 * 2 * (n - 1) / n)


def test_sizes_parse_binary_and_decimal_units():
    assert [bandwidth.parse_size(s) for s in ("4096", "4KiB", "1 MiB", "1GiB", "64MB", "1.5KiB")] == \
        [4096, 4096, 2**20, 2**30, 64 * 10**6, 1536]
    for bad in ("0", "-1", "1.5", "4 parsecs", ""):
        with pytest.raises(ValueError):
            bandwidth.parse_size(bad)
    assert bandwidth.format_size(2**30) == "1 GiB" and bandwidth.format_size(100) == "100 B"


@pytest.mark.parametrize("busbw,name", [
    (1.0, "slower than PCIe 3"), (12.0, "PCIe 3.0"), (16.9, "PCIe 3.0"), (17.0, "PCIe 4.0"), (24.0, "PCIe 4.0"),
    (48.0, "PCIe 5.0"), (104.0, "PCIe 5.0"), (230.0, "A100"), (370.0, "H100"), (480.0, "H100"),
])
def test_link_class_is_the_fastest_class_whose_floor_is_reached(busbw, name):
    assert name in bandwidth.link_class(busbw, "nccl").name


def test_link_classes_split_between_neighbours_typical_values():
    classes = bandwidth.GPU_LINK_CLASSES
    assert classes[0].floor == 0
    for below, above in zip(classes, classes[1:]):
        assert below.typical < above.floor < above.typical, above.name
        assert bandwidth.link_class(above.typical, "nccl") == above
    assert bandwidth.link_class(50.0, "gloo") is bandwidth.CPU_GLOO  # Gloo says nothing of GPU links
    assert bandwidth.link_class(0.0, "nccl") is None and bandwidth.link_class(0.0, "gloo") is None


# --- nvidia-smi topo -m (pure) ---

def test_topology_of_an_8x_h100_box_is_nvlink_everywhere():
    matrix = topology.parse_topo(H100_8)
    assert matrix["devices"] == [f"GPU{i}" for i in range(8)] + ["NIC0", "NIC1"]
    reading = topology.read_topology(matrix)
    assert reading["counts"] == {"NV18": 28} and reading["nvlink_pairs"] == 28 and reading["slowest"] is None
    assert "NVLink between every pair" in reading["reading"]
    assert topology.read_topology(matrix, [0, 5])["pairs"] == {"0-5": "NV18"}


def test_topology_of_a_4x_pcie_box_names_its_slowest_hop():
    reading = topology.read_topology(topology.parse_topo(PCIE_4))
    assert reading["counts"] == {"NODE": 2, "SYS": 4} and reading["nvlink_pairs"] == 0
    assert reading["pcie_pairs"] == 6 and reading["slowest"] == "SYS"
    assert "no NVLink" in reading["reading"] and "SYS" in reading["reading"]
    # Two ranks on CUDA_VISIBLE_DEVICES=2,3 use one NUMA node's pair.
    gpus = topology.gpus_in_use(2, "2,3")
    assert gpus == [2, 3]
    assert topology.read_topology(topology.parse_topo(PCIE_4), gpus)["pairs"] == {"2-3": "NODE"}
    assert topology.gpus_in_use(2, None) == [0, 1] and topology.gpus_in_use(2, "GPU-3f2a,GPU-77b1") is None


def test_topology_with_nvlink_between_some_pairs_says_so():
    reading = topology.read_topology(topology.parse_topo(MIXED_4))
    assert reading["counts"] == {"NV12": 2, "NODE": 4} and reading["slowest"] == "NODE"
    assert "some pairs only" in reading["reading"]
    with pytest.raises(ValueError, match="GPU0"):
        topology.parse_topo("No devices were found\n")


# --- flags ---

@pytest.mark.parametrize("argv,flag", [(["--sizes", "0"], "--sizes"), (["--sizes", "4KiB,big"], "--sizes"),
                                       (["--iters", "0"], "--iters"), (["--compute", "-1"], "--compute")])
def test_a_bad_flag_is_an_error_naming_it_on_rank_0_only(argv, flag, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    assert check.main(argv) == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and "python -m zeroshard check" in err
    monkeypatch.setenv("RANK", "1")
    assert check.main(argv) == 2
    assert capsys.readouterr() == ("", "")


def _env(**extra):
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [PACKAGE_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]), **extra)


def _run(command, env, cwd):
    """(exit code, stdout, stderr); a run past RUN_TIMEOUT is stopped (torchrun passes SIGTERM
    on to its workers) and fails the test."""
    proc = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"{command} ran past {RUN_TIMEOUT} s:\n{out[-3000:]}\n{err[-3000:]}")
    return proc.returncode, out, err


def test_a_size_below_one_element_per_rank_is_an_error_naming_the_flag(tmp_path):
    code, out, err = _run([sys.executable, "-m", "zeroshard", "check", "--sizes", "2B"], _env(), tmp_path)
    assert code == 2, out + err
    assert "zeroshard check: error: --sizes: 2 B is less than one float32 per rank" in err


# --- a real run: torchrun, 2 ranks, Gloo, a fake nvidia-smi on PATH ---

@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("check")
    (tmp / "topo.txt").write_text(PCIE_4)
    fake = tmp / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        echo "$@" >> {tmp / 'calls.log'}
        [ "$1 $2" = "topo -m" ] && exec cat {tmp / 'topo.txt'}
        exit 9
        """))
    fake.chmod(0o755)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "zeroshard", "check", "--sizes", ",".join(map(str, SIZES)), "--iters", "2", "--warmup", "1",
               "--grad-size", "64KiB", "--compute", "0.1G", "--timeout", "60", "--json", str(tmp / "out.json")]
    env = _env(PATH=f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    code, out, err = _run(command, env, tmp)
    assert code == 0, f"exit {code}\n{out[-4000:]}\n{err[-4000:]}"
    return {"out": out, "err": err, "json": json.loads((tmp / "out.json").read_text()),
            "calls": (tmp / "calls.log").read_text().splitlines()}


def test_the_table_has_a_row_per_collective_and_size(two_ranks):
    rows = [line.split() for line in two_ranks["out"].splitlines()
            if line.split()[:1] and line.split()[0] in bandwidth.COLLECTIVES]
    assert [(r[0], r[1] + " " + r[2]) for r in rows] == [
        (c, bandwidth.format_size(s)) for s in SIZES for c in bandwidth.COLLECTIVES]
    for r, j in zip(rows, two_ranks["json"]["collectives"]):  # the table prints the JSON's numbers
        assert float(r[3]) == pytest.approx(j["seconds"] * 1e6, abs=0.06)
        assert float(r[5]) == pytest.approx(j["busbw_GBps"], abs=6e-4)
    assert "busbw = algbw * 2(n-1)/n for all_reduce" in two_ranks["out"]


def test_json_bandwidths_follow_the_nccl_tests_definitions(two_ranks):
    report = two_ranks["json"]
    assert report["ranks"] == 2 and report["backend"] == "gloo"
    factor = {"all_reduce": 2 * (2 - 1) / 2, "reduce_scatter": (2 - 1) / 2, "all_gather": (2 - 1) / 2}
    for row in report["collectives"]:
        assert row["bytes"] == row["requested_bytes"] in SIZES  # S: the full buffer
        assert row["seconds"] > 0
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / row["seconds"] / 1e9, rel=1e-12)
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * factor[row["collective"]], rel=1e-12)
    best = max(report["collectives"], key=lambda r: r["busbw_GBps"])
    assert report["link"]["best_busbw_GBps"] == best["busbw_GBps"]
    assert report["link"]["class"] == bandwidth.CPU_GLOO.name
    s = report["scaling"]
    assert s["speedup"] == pytest.approx(s["one_rank_seconds"] / s["ranks_seconds"])
    assert s["threshold_speedup"] == pytest.approx(1.3) and s["warned"] == (s["speedup"] < 1.3)
    assert s["matmuls"] % 2 == 0 and s["grad_bytes"] == 64 * 1024
    assert ("warning: 2 ranks run this step only" in two_ranks["err"]) == s["warned"]


def test_only_rank_0_prints(two_ranks):
    out = two_ranks["out"]
    assert out.count("zeroshard check: 2 ranks") == 1
    assert sum(line.startswith("collective ") for line in out.splitlines()) == 1
    assert out.count("nvidia-smi topo -m:") == 1 and out.count("scaling:") == 1
    assert two_ranks["calls"] == ["topo -m"]  # rank 0 alone asked nvidia-smi


def test_a_fake_nvidia_smi_is_printed_and_read(two_ranks):
    out = two_ranks["out"]
    assert "  GPU2    SYS     SYS      X      NODE" in out
    assert "topology (this run used no GPU: every GPU of the machine): GPU 0, 1, 2, 3: no NVLink" in out
    topo = two_ranks["json"]["topology"]
    assert topo["counts"] == {"NODE": 2, "SYS": 4} and topo["slowest"] == "SYS"
