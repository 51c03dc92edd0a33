"""Run a function on P ranks (gloo on CPU, or NCCL with one GPU per rank) spawned from pytest, with a
free port and a bounded timeout; run a launcher command (torchrun) whose whole process tree is killed
when it overruns its timeout."""

from __future__ import annotations

import datetime
import io
import os
import signal
import socket
import subprocess
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 60


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc), children first."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(proc: subprocess.Popen) -> list[int]:
    """SIGKILL ``proc`` and every process under it; return the descendants' pids.

    torchrun starts each worker in a session of its own, so killing the launcher (or its process
    group) alone leaves the ranks running, holding ports, cores and build locks.
    """
    victims = descendants(proc.pid)
    for pid in victims + [proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)
    return victims


def finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """``proc.communicate()`` with a deadline: past ``timeout`` seconds, kill the whole process
    tree and raise AssertionError with the tail of what it printed."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        _, err = proc.communicate()
        raise AssertionError(f"{' '.join(map(str, proc.args[:6]))} ... ran past {timeout} s; killed it and its "
                             f"workers.\nstderr tail:\n{(err or '')[-4000:]}") from None


def run_command(cmd: list[str], *, timeout: float, **popen_kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` with :func:`finish`'s deadline."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen_kwargs)
    out, err = finish(proc, timeout)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue, backend, timeout_s):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        kwargs = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            kwargs["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
        result = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(result, buf)  # bytes, not shared-memory tensors: the rank exits right after
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException as exc:  # report every failure to the parent, then exit
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 2 * TIMEOUT_S, backend: str = "gloo") -> list:
    """:func:`_run_ranks_once`, started once more on a new port when another process took the
    free port between choosing it and rank 0's listen (EADDRINUSE)."""
    try:
        return _run_ranks_once(fn, world_size, *args, timeout=timeout, backend=backend)
    except RuntimeError as exc:
        if "EADDRINUSE" not in str(exc):
            raise
        return _run_ranks_once(fn, world_size, *args, timeout=timeout, backend=backend)


def _run_ranks_once(fn, world_size: int, *args, timeout: float = 2 * TIMEOUT_S, backend: str = "gloo") -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return results by rank.

    backend: "gloo" (CPU) or "nccl" (rank r on cuda:r; needs world_size GPUs).
    ``fn`` must be a module-level function; its result must be picklable (use CPU tensors).
    Raises RuntimeError with every failing rank's traceback, or when a rank does not report in time.
    """
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise RuntimeError(f"NCCL run of {world_size} ranks needs {world_size} GPUs, found {torch.cuda.device_count()}")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, backend, timeout / 2)) for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors[rank] = payload
    except Exception as exc:
        errors[-1] = f"no report within {timeout} s ({type(exc).__name__})"
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items())))
    return [results[r] for r in range(world_size)]
