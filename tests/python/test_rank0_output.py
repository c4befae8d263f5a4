"""Rank-0 output: a line every rank would print the same comes from rank 0 alone (a warning about
one rank stays on that rank), and the long operations (save_checkpoint, load_checkpoint,
load_pretrained, save_16bit_model, convert) draw a progress line on rank 0's stderr when it is
a terminal, ended by a newline, and not one byte of it anywhere else (another rank, a pipe).

Each rank of one 2-rank spawn records its warnings and runs the operations twice, its stderr
(fd 2) first a pty's slave end, then a pipe; the parent reads both back. The command line
(python -m zeroshard.convert) runs in a fresh interpreter with its stderr a pty, then a pipe."""

import os
import pty
import re
import select
import subprocess
import sys
import time
import tty
from contextlib import contextmanager

import pytest

from checkpoint_runs import config as _config
from models import make_stateful_model
from spawn import SharedRuns

READ_TIMEOUT = 60.0  # seconds to wait for output that is due; normally it is there at once


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("rank0")


@pytest.fixture(scope="module")
def runs(out):
    return SharedRuns({2: {"warnings": (_warnings_seen, str(out / "warnings")),
                           "progress": (_progress_drawn, str(out / "progress"))}})


# ---- warnings -------------------------------------------------------------------------------

def _recorded(action):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        action()
    return [str(w.message) for w in caught]


def _warnings_seen(rank, world_size, directory):
    """What each warning path warns on this rank: Python's (a config read, initialize, the
    DeepSpeed layer) and the C++ core's (save_16bit_model, load_checkpoint)."""
    import torch

    import zeroshard
    from zeroshard import deepspeed
    from zeroshard._warnings import warn_at_caller

    seen = {}
    ignored_key = {"train_micro_batch_size_per_gpu": 2, "tensorboard": {}}
    seen["config"] = _recorded(lambda: zeroshard.Config.from_dict(ignored_key))

    warmup = {"type": "WarmupLR", "params": {"warmup_num_steps": 4}}
    engines = {}

    def initialize():
        model = make_stateful_model(0)
        cfg = _config(world_size, 3) | {"tensorboard": {}, "scheduler": warmup}
        scheduler = lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0)  # noqa: E731
        engines["client"] = zeroshard.initialize(model, cfg, lr_scheduler=scheduler)
    seen["initialize"] = _recorded(initialize)
    def zero_init():
        with deepspeed.zero.Init(config_dict_or_path={}):
            pass
    seen["zero.Init"] = _recorded(zero_init)

    # The C++ core's: stage 3 without the gather flag saves nothing; a checkpoint saved with
    # WarmupLR resumed under WarmupDecayLR.
    saver = zeroshard.initialize(make_stateful_model(0), _config(world_size, 3) | {"scheduler": warmup})
    seen["save_16bit_model"] = _recorded(lambda: saver.save_16bit_model(os.path.join(directory, "export")))
    saver.save_checkpoint(os.path.join(directory, "ckpt"), tag="warmup")
    decay = {"type": "WarmupDecayLR", "params": {"total_num_steps": 10, "warmup_num_steps": 4}}
    loader = zeroshard.initialize(make_stateful_model(0), _config(world_size, 3) | {"scheduler": decay})
    seen["load_checkpoint"] = _recorded(lambda: loader.load_checkpoint(os.path.join(directory, "ckpt"), tag="warmup"))

    seen["about this rank"] = _recorded(lambda: warn_at_caller(f"rank {rank}: its own words", every_rank=True))
    return seen


# What each path must warn, once, on rank 0 only.
WARNED = {
    "config": ['"tensorboard"'],
    "initialize": ['"tensorboard"', "scheduler (WarmupLR) is not used"],
    "zero.Init": ["builds the model whole"],
    "save_16bit_model": ["stage3_gather_16bit_weights_on_model_save"],
    "load_checkpoint": ["saved with scheduler WarmupLR, resumed with WarmupDecayLR"],
}


@pytest.mark.parametrize("path", sorted(WARNED))
def test_a_warning_every_rank_would_give_comes_once_from_rank_0(runs, path):
    rank0, rank1 = (seen[path] for seen in runs.result(2, "warnings"))
    for expected in WARNED[path]:
        assert sum(expected in w for w in rank0) == 1, (expected, rank0)
    assert len(rank0) == len(WARNED[path]), rank0
    assert rank1 == [], f"rank 1 repeats rank 0's warnings: {rank1}"


def test_a_warning_about_one_rank_is_given_on_that_rank(runs):
    for rank, seen in enumerate(runs.result(2, "warnings")):
        assert seen["about this rank"] == [f"rank {rank}: its own words"]


# ---- progress -------------------------------------------------------------------------------

def _read_all(master, until_closed=True):
    """Everything the master side of a pty holds, read without blocking: until every slave end is
    closed (EIO), within READ_TIMEOUT."""
    data, end = b"", time.monotonic() + READ_TIMEOUT
    while True:
        ready, _, _ = select.select([master], [], [], max(0.0, end - time.monotonic()))
        if not ready:
            raise TimeoutError(f"no end of output within {READ_TIMEOUT} s; read so far: {data!r}")
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the slave side is closed and everything was read
            return data
        if not chunk:
            return data
        data += chunk


@contextmanager
def _stderr_to(fd):
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(fd, 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _operations(engine, directory, rank):
    import zeroshard.convert

    engine.save_checkpoint(os.path.join(directory, "ckpt"), tag="t")
    engine.load_checkpoint(os.path.join(directory, "ckpt"), tag="t")
    engine.save_16bit_model(os.path.join(directory, "export"))
    engine.load_pretrained(os.path.join(directory, "export"))
    ckpt = os.path.join(directory, "ckpt", "t")
    zeroshard.convert.convert(ckpt, os.path.join(directory, f"rank{rank}.safetensors"))
    zeroshard.convert.convert(ckpt, os.path.join(directory, f"rank{rank}.pt"))


def _progress_drawn(rank, world_size, directory):
    """(what reached a terminal, what reached a pipe) on this rank's stderr during the operations."""
    import zeroshard

    engine = zeroshard.initialize(make_stateful_model(0), _config(world_size, 2))
    master, slave = pty.openpty()
    tty.setraw(slave)  # bytes as written: no "\n" -> "\r\n"
    with _stderr_to(slave):
        assert os.isatty(2)
        _operations(engine, os.path.join(directory, "pty"), rank)
    os.close(slave)
    terminal = _read_all(master)
    os.close(master)
    read_end, write_end = os.pipe()
    with _stderr_to(write_end):
        _operations(engine, os.path.join(directory, "pipe"), rank)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        piped = f.read()
    return terminal.decode(), piped.decode()


def _final_line(title):
    return re.compile(r"\rzeroshard " + re.escape(title) + r": (\d+)/\1 tensors, [0-9.]+ [KMG]?B, [0-9.]+ s\n")


def test_the_long_operations_show_progress_on_rank_0_at_a_terminal(runs, out):
    terminal, _ = runs.result(2, "progress")[0]
    d = out / "progress" / "pty"
    titles = ["save 't'", f"load '{d / 'ckpt' / 't'}'", f"save_16bit_model '{d / 'export' / 'model.safetensors'}'",
              f"load_pretrained '{d / 'export'}'", f"convert '{d / 'ckpt' / 't'}'"]
    for title in titles:
        finals = _final_line(title).findall(terminal)
        assert len(finals) == (2 if title.startswith("convert") else 1), (title, terminal)
    assert terminal.endswith("\n")
    # Every line is a progress line, redrawn in place ("\r") and ended once.
    lines = terminal.split("\n")[:-1]
    assert len(lines) == len(titles) + 1, terminal
    assert all(line.startswith("\rzeroshard ") for line in lines), terminal


def test_no_progress_on_other_ranks_or_into_a_pipe(runs):
    (_, rank0_piped), (rank1_terminal, rank1_piped) = runs.result(2, "progress")
    assert rank1_terminal == "", "rank 1 draws progress too"
    assert rank0_piped == "" and rank1_piped == "", "progress reached a pipe"


def _convert_cli(ckpt, target, stderr_tty):
    """(stdout, stderr) of python -m zeroshard.convert, its stderr a pty or a pipe."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, "-m", "zeroshard.convert", str(ckpt), str(target)]
    if not stderr_tty:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=READ_TIMEOUT)
        assert done.returncode == 0, done.stderr
        return done.stdout, done.stderr
    master, slave = pty.openpty()
    tty.setraw(slave)
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=slave, text=True)
    os.close(slave)
    try:
        err = _read_all(master).decode()
        stdout, _ = proc.communicate(timeout=READ_TIMEOUT)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    return stdout, err


def test_the_convert_command_shows_progress_only_at_a_terminal(runs, out):
    """The .pt writer's loop, which is Python's (the .safetensors one is C++'s, as above)."""
    runs.result(2, "progress")  # the checkpoint
    ckpt = out / "progress" / "pipe" / "ckpt" / "t"
    stdout, err = _convert_cli(ckpt, out / "cli_tty.pt", stderr_tty=True)
    line = r"\rzeroshard convert '" + re.escape(str(ckpt)) + r"': (\d+)/(\d+) tensors, [^\r\n]* s\n$"
    [(done, total)] = re.findall(line, err)
    assert done == total and stdout == f"wrote {total} tensors to {out / 'cli_tty.pt'}\n"
    _, err = _convert_cli(ckpt, out / "cli_pipe.pt", stderr_tty=False)
    assert err == ""


def test_before_torch_distributed_the_rank_is_the_launchers(monkeypatch):
    """A Config read under torchrun before init_process_group (or a tool started with RANK set)
    warns on rank 0 only, and draws no progress on the others."""
    import warnings

    import zeroshard
    from zeroshard._rank import this_rank

    for rank, copies in (("0", 1), ("3", 0)):
        monkeypatch.setenv("RANK", rank)
        assert this_rank() == int(rank)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            zeroshard.Config.from_dict({"tensorboard": {}})
        assert len(caught) == copies
    monkeypatch.delenv("RANK")
    assert this_rank() == 0  # a lone process
