"""A full disk: a save into a file system with no room for it fails on every rank with an error
naming the file, the OS's error and the space left; the previous checkpoint stays intact and
`latest`, nothing of the failed save is left behind, and a save once there is room succeeds.

The file system is real: a 1 MiB tmpfs the test mounts (as root), filled by a file beside the
checkpoints until less than half a rank file is free, so writes fail with ENOSPC. Where mounting
is not allowed (or with ZEROSHARD_TEST_FULL_DISK=fsize) each rank's file size limit
(RLIMIT_FSIZE, SIGXFSZ ignored) makes the same writes fail with EFBIG. A second case limits rank
1 only, so that rank 0, whose own writes succeed, must tell rank 1's error. Two ranks, one
spawned run (spawn.SharedRuns).
"""

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from checkpoint_runs import config as _config
from checkpoint_runs import train as _train
from models import make_stateful_model
from spawn import SharedRuns

WORLD = 2
TMPFS_BYTES = 1 << 20  # a checkpoint of the test model is ~40 KB


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    """(directory, how it fills up): "tmpfs" mounted there, or "fsize" on the usual disk."""
    where = tmp_path_factory.mktemp("full_disk")
    mounted = False
    if os.environ.get("ZEROSHARD_TEST_FULL_DISK") != "fsize":
        try:
            mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(where)],
                                     capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            mounted = False  # no mount(8), or no privilege to use it
    yield where, "tmpfs" if mounted else "fsize"
    if mounted:
        if subprocess.run(["umount", str(where)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def _free_bytes(path):
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def _save_into_a_full_disk(rank, world_size, where, how, limited_rank=None):
    import resource
    import signal

    import zeroshard

    where = Path(where)
    ckpt, filler = where / "ckpt", where / "filler"
    model = make_stateful_model(0)
    engine = zeroshard.initialize(model, _config(world_size, 2))
    _train(model, engine, rank, world_size, range(2))
    engine.save_checkpoint(ckpt)  # global_step2, with room to spare
    previous = engine.full_state_dict()
    rank_file = (ckpt / "global_step2" / "rank_00000.safetensors").stat().st_size
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.getsignal(signal.SIGXFSZ)
    if how == "tmpfs" and rank == 0:
        filler.write_bytes(b"\0" * (_free_bytes(where) - rank_file // 2))
    elif how == "fsize" and limited_rank in (None, rank):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (rank_file // 2, limit[1]))
    torch.distributed.barrier()
    _train(model, engine, rank, world_size, range(2, 3))
    try:
        engine.save_checkpoint(ckpt)
        error = None
    except RuntimeError as e:
        error = str(e)
    torch.distributed.barrier()
    listing = sorted(os.listdir(ckpt))
    latest = (ckpt / "latest").read_text()
    path, _ = engine.load_checkpoint(ckpt)  # the previous one, whole
    reloaded = engine.full_state_dict()

    # Room again: the same save succeeds and loads back.
    if how == "tmpfs" and rank == 0:
        filler.unlink()
    elif how == "fsize":
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)
    torch.distributed.barrier()
    _train(model, engine, rank, world_size, range(2, 3))
    saved_path = engine.save_checkpoint(ckpt)
    saved = engine.full_state_dict()
    torch.distributed.barrier()
    loaded_path, _ = engine.load_checkpoint(ckpt)
    return {"error": error, "listing": listing, "latest": latest, "path": path, "previous": previous,
            "reloaded": reloaded, "rank_file": rank_file, "saved_path": saved_path, "saved": saved,
            "loaded_path": loaded_path, "loaded": engine.full_state_dict(),
            "listing_after": sorted(os.listdir(ckpt))}


@pytest.fixture(scope="module")
def runs(disk, tmp_path_factory):
    where, how = disk
    return SharedRuns({WORLD: {"full_disk": (_save_into_a_full_disk, str(where), how),
                               "limit_on_rank_1": (_save_into_a_full_disk,
                                                   str(tmp_path_factory.mktemp("limit_on_rank_1")), "fsize", 1)}})


def _assert_equal(a, b):
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, different


def _assert_names_the_file_and_the_space_left(results, ckpt, how, failed_file=r"rank_0000\d.safetensors"):
    reason = "No space left on device" if how == "tmpfs" else "File too large"
    for rank, result in enumerate(results):
        error = result["error"]
        assert error is not None, f"rank {rank}: the save into a full disk succeeded"
        assert f"saving '{ckpt}/global_step3' failed on rank" in error, error
        # Whichever rank ran out first, every rank's message names its file and the space left.
        named = re.search(rf"writing '{re.escape(str(ckpt))}/\.staging-global_step3/{failed_file}' failed after "
                          rf"\d+ bytes: {reason} \(the file system of '[^']+' has (\d+) bytes", error)
        assert named, error
        if how == "tmpfs":
            assert int(named.group(1)) < result["rank_file"], error  # statvfs, after the failed write
        assert "nothing was published" in error, error


def test_a_save_into_a_full_disk_fails_on_every_rank_naming_the_file_and_the_free_space(runs, disk):
    where, how = disk
    _assert_names_the_file_and_the_space_left(runs.result(WORLD, "full_disk"), where / "ckpt", how)


def test_a_rank_whose_writes_succeeded_tells_the_error_of_the_rank_that_failed(runs):
    results = runs.result(WORLD, "limit_on_rank_1")
    ckpt = Path(results[0]["saved_path"]).parent
    _assert_names_the_file_and_the_space_left(results, ckpt, "fsize", failed_file="rank_00001.safetensors")
    assert "failed on rank(s) 1: rank 1: zeroshard checkpoint: writing" in results[0]["error"]
    assert "failed on rank 1: zeroshard checkpoint: writing" in results[1]["error"]


@pytest.mark.parametrize("case", ["full_disk", "limit_on_rank_1"])
def test_a_full_disk_leaves_the_previous_checkpoint_latest_whole_and_nothing_else(runs, case):
    for result in runs.result(WORLD, case):
        assert result["listing"] == ["global_step2", "latest"]  # no tag, no staging directory
        assert result["latest"] == "global_step2"
        assert result["path"].endswith("global_step2")
        _assert_equal(result["reloaded"], result["previous"])


@pytest.mark.parametrize("case", ["full_disk", "limit_on_rank_1"])
def test_with_room_again_the_save_succeeds_and_loads(runs, case):
    for result in runs.result(WORLD, case):
        assert result["saved_path"].endswith("global_step3") and result["loaded_path"] == result["saved_path"]
        assert result["listing_after"] == ["global_step2", "global_step3", "latest"]
        _assert_equal(result["loaded"], result["saved"])
