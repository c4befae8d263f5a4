"""Runs torchrun launchers (python -m torch.distributed.run) of the main job, examples/train_gpt.py,
with a deadline: the two-node tests and the restart tests.

Each launcher writes its output to a file; on its deadline the launcher's process group and its
workers' (torchrun starts each worker in a session of its own) are killed.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_gpt.py"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_command(nnodes, nproc, port, script_args, rdzv_conf=None, program=EXAMPLE, max_restarts=0):
    """torchrun as one node of `nnodes`, each of `nproc` ranks, meeting at 127.0.0.1:port, restarting
    its workers up to max_restarts times; a program that is not a .py file is run as it is (--no-python)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
               "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", f"launch-{port}", "--local-addr", "127.0.0.1", "--max-restarts", str(max_restarts)]
    if rdzv_conf:
        command += ["--rdzv-conf", rdzv_conf]
    if Path(program).suffix != ".py":
        command.append("--no-python")
    return command + [str(program), *script_args]


def descendants(pid):
    """Every process below pid (from /proc's parent links)."""
    children = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                # The field after the command's closing parenthesis: state, then the parent's pid.
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_launcher(proc):
    """The launcher's process group and the groups of the workers it started."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:  # not a group leader, or already gone
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    proc.wait(timeout=30)


def run_launchers(commands, logs, timeout, envs=None):
    """Starts every command at once, each in its own process group with its output in its log
    (and the variables of envs[i] added to its environment); returns [(exit code or None if
    killed at the deadline, output)], seconds taken."""
    start = time.monotonic()
    procs = []
    for i, (command, log) in enumerate(zip(commands, logs)):
        env = dict(os.environ, OMP_NUM_THREADS="1", **(envs[i] if envs else {}))
        with open(log, "w") as out:
            procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, start + timeout - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for proc, code in zip(procs, codes):
        if code is None:
            kill_launcher(proc)
    return [(code, Path(log).read_text()) for code, log in zip(codes, logs)], time.monotonic() - start


def report(results):
    return "\n".join(f"--- launcher {i} ({'killed at the deadline' if code is None else f'exit {code}'}) ---\n"
                     f"{out[-6000:]}" for i, (code, out) in enumerate(results))
