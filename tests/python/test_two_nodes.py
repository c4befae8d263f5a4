"""Two nodes on one machine: two torchrun launchers (`--nnodes 2 --nproc-per-node 2`, c10d
rendezvous on 127.0.0.1) run the main job, examples/train_gpt.py, as the two nodes of one job.

Held to: the rendezvous makes them node 0 and node 1 (GROUP_RANK) of 2 ranks each
(LOCAL_WORLD_SIZE), and with hybrid sharding in shard groups of 2 the run is bitwise the run of
one launcher of 4 ranks with the same config (losses, and the weights of the checkpoint it
saves). With shard_group_size "node" the groups follow the launchers (2 groups of 2), while one
launcher of 4 is one node (flat): the losses agree to rounding. A node that never joins makes
the other fail the rendezvous with torchrun's own error, in bounded time.

Each launcher has a deadline (launchers.py). Four runs of 4 ranks and one lone launcher: ~85 s on 2 cores, nearly all of
it 6 processes importing torch per run.
"""

import json

import pytest
import torch

from launchers import ROOT, free_port, launcher_command, report, run_launchers
from zeroshard.convert import convert

CPP_EXAMPLE = ROOT / "build" / "examples" / "cpp" / "zeroshard_train_example"  # scripts/setup.sh --all
STEPS, SEQ = 3, 32
RUN_TIMEOUT = 240  # a run takes ~20 s on 2 cores
JOIN_TIMEOUT = 3  # seconds the lone node waits for the other in the rendezvous


def _config(tmp, shard_group_size):
    """configs/hybrid.json as shipped (shard groups of a node) for "node", else a copy with this
    size, whose collectives give up within a minute (ranks that disagree on it fail in initialize)."""
    shipped = ROOT / "configs" / "hybrid.json"
    if shard_group_size == "node":
        return shipped
    config = json.loads(shipped.read_text())
    config["zeroshard"].update(shard_group_size=shard_group_size, collective_timeout_seconds=60)
    path = tmp / f"hybrid_{shard_group_size}.json"
    path.write_text(json.dumps(config))
    return path


class Runs:
    """Each layout run once, when a test first asks for it: {"summary", "weights", "output"}, or
    the AssertionError of its failure, raised again for every test that asks."""

    def __init__(self, tmp):
        self._tmp, self._done = tmp, {}

    def get(self, nnodes, shard_group_size):
        key = (nnodes, shard_group_size)
        if key not in self._done:
            try:
                self._done[key] = self._run(nnodes, shard_group_size)
            except AssertionError as e:
                self._done[key] = e
        if isinstance(self._done[key], AssertionError):
            raise self._done[key]
        return self._done[key]

    def _run(self, nnodes, shard_group_size):
        work = self._tmp / f"nodes{nnodes}_group_{shard_group_size}"
        work.mkdir()
        args = ["--config", str(_config(self._tmp, shard_group_size)), "--steps", str(STEPS), "--seq", str(SEQ),
                "--log-every", "1", "--save-dir", str(work / "ckpt"), "--summary", str(work / "summary.json")]
        command = launcher_command(nnodes, 4 // nnodes, free_port(), args)
        results, _ = run_launchers([command] * nnodes, [work / f"launcher{i}.log" for i in range(nnodes)],
                                   RUN_TIMEOUT)
        assert all(code == 0 for code, _ in results), report(results)
        convert(work / "ckpt", work / "weights.pt")
        return {"summary": json.loads((work / "summary.json").read_text()),
                "weights": torch.load(work / "weights.pt"), "output": report(results)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("two_nodes"))


def _assert_two_nodes_of_two(run):
    ranks = run["summary"]["ranks"]
    assert [(r["RANK"], r["GROUP_RANK"], r["LOCAL_RANK"], r["LOCAL_WORLD_SIZE"]) for r in ranks] == [
        ("0", "0", "0", "2"), ("1", "0", "1", "2"), ("2", "1", "0", "2"), ("3", "1", "1", "2")], run["output"]
    assert all(r["comm_levels"] == ["inter", "intra"] for r in ranks), ranks
    assert run["summary"]["plan"].splitlines()[0] == (
        "parameters: sharded over ranks 0-1 (2 shards) in each of 2 groups of consecutive ranks "
        "(2 copies of each shard), on cpu"), run["output"]


def test_two_launchers_are_two_nodes_and_train_bitwise_as_one_launcher_of_four(runs):
    two, one = runs.get(2, 2), runs.get(1, 2)
    _assert_two_nodes_of_two(two)
    assert {r["LOCAL_WORLD_SIZE"] for r in one["summary"]["ranks"]} == {"4"}
    assert one["summary"]["plan"] == two["summary"]["plan"]
    assert two["summary"]["losses"] == one["summary"]["losses"], two["output"] + one["output"]
    assert len(two["summary"]["losses"]) == STEPS
    assert two["weights"].keys() == one["weights"].keys()
    different = [name for name, value in one["weights"].items() if not torch.equal(two["weights"][name], value)]
    assert not different, f"weights differ: {different}"


def test_node_groups_follow_the_launchers(runs):
    """"node" is LOCAL_WORLD_SIZE: 2 groups of 2 over two launchers; one group of 4 (flat,
    no levels) under one launcher of 4. The same training up to the sums' order."""
    two, one = runs.get(2, "node"), runs.get(1, "node")
    _assert_two_nodes_of_two(two)
    assert two["summary"]["losses"] == runs.get(2, 2)["summary"]["losses"], "\"node\" is not a group of 2"
    assert one["summary"]["plan"].splitlines()[0] == "parameters: sharded over ranks 0-3 (4 shards), on cpu"
    assert all(r["comm_levels"] == [] for r in one["summary"]["ranks"])
    steps = [str(s) for s in range(1, STEPS + 1)]
    assert [two["summary"]["losses"][s] for s in steps] == pytest.approx(
        [one["summary"]["losses"][s] for s in steps], rel=1e-5)


def test_a_node_that_never_joins_fails_the_rendezvous_in_bounded_time(tmp_path):
    args = ["--config", str(_config(tmp_path, "node")), "--steps", str(STEPS), "--seq", str(SEQ)]
    command = launcher_command(2, 2, free_port(), args, rdzv_conf=f"join_timeout={JOIN_TIMEOUT}")
    results, seconds = run_launchers([command], [tmp_path / "lone.log"], timeout=120)
    code, output = results[0]
    assert code is not None, f"the lone node hung past 120 s:\n{report(results)}"
    assert code != 0 and "RendezvousTimeoutError" in output, report(results)
    assert "zeroshard stage" not in output, "the job started without its second node"
    assert seconds < JOIN_TIMEOUT + 60, seconds


def _cpp_run(tmp, nnodes, shard_group_size):
    """The C++ example (examples/cpp/train.cpp) under nnodes launchers of 4 // nnodes ranks:
    rank 0's output, from its plan on."""
    command = launcher_command(nnodes, 4 // nnodes, free_port(),
                               ["--config", str(_config(tmp, shard_group_size)), "--steps", str(STEPS)],
                               program=CPP_EXAMPLE)
    logs = [tmp / f"cpp_{nnodes}_{shard_group_size}_{i}.log" for i in range(nnodes)]
    results, _ = run_launchers([command] * nnodes, logs, RUN_TIMEOUT)
    assert all(code == 0 for code, _ in results), report(results)
    text = "\n".join(out for _, out in results)
    assert "plan:" in text, report(results)
    return text[text.index("plan:"):], report(results)


def test_a_cpp_program_reads_the_nodes_from_torchrun(tmp_path):
    """initProcessGroupFromEnv under two launchers: "node" is the LOCAL_WORLD_SIZE torchrun set
    (2 groups of 2, with the bytes inside and across nodes), and the run is line for line the
    one of a single launcher of 4 with shard groups of 2 given explicitly."""
    if not CPP_EXAMPLE.exists():
        pytest.skip(f"{CPP_EXAMPLE} is not built (bash scripts/setup.sh --all builds it)")
    two, two_report = _cpp_run(tmp_path, 2, "node")
    one, one_report = _cpp_run(tmp_path, 1, 2)
    assert "in each of 2 groups of consecutive ranks" in two.splitlines()[1], two_report
    assert "inside a node" in two and "across nodes" in two, two_report
    assert [line for line in two.splitlines() if line.startswith(("step", "model state", "last step", "final"))] == \
        [line for line in one.splitlines() if line.startswith(("step", "model state", "last step", "final"))], \
        two_report + one_report
