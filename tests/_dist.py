"""Run a function on P ranks (gloo on CPU, or NCCL with one GPU per rank) spawned from pytest, with a
free port and a bounded timeout."""

from __future__ import annotations

import datetime
import io
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 60


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
