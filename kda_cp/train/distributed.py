"""Distributed init and the 2-D process layout of training: data parallel (dp) x context parallel (cp).

:class:`ParallelDims` is modeled on torchtitan's: the degrees are checked against the world size
when the object is made, and the named ``DeviceMesh`` (axes "dp", "cp"; cp inner, so ranks
``d * cp .. d * cp + cp - 1`` share one sequence) is built lazily, on first use, from
``torch.distributed.device_mesh.init_device_mesh``.

    dims = ParallelDims(dp=2, cp=2, world_size=4)
    mesh = dims.build_mesh("cpu")              # collective: every rank calls it
    cp_group = dims.cp_group                   # None when cp == 1 (an unsharded sequence)

Rank r sits at mesh coordinates ``(r // cp, r % cp)`` (:meth:`ParallelDims.coords`).
:func:`init_distributed` starts torch.distributed from torchrun's environment and returns this
process's :class:`Layout`; :func:`broadcast_object` and :func:`agree` are the trainer's collectives
for decisions made on one rank or errors met on some.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from kda_cp.train.config import ParallelConfig, cpu_backend

__all__ = ["ParallelDims", "Layout", "build_layout", "init_distributed", "broadcast_object", "agree"]


def _set_timeout(group, timeout: timedelta) -> None:
    """Set the collective deadline of an existing group (torch keeps this setter private)."""
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is not None:
        setter(timeout, group)


@dataclass
class ParallelDims:
    """Degrees of data and context parallelism over ``world_size`` ranks.

    Args:
        dp: data-parallel degree (ranks that take different sequences of the global batch), >= 1.
        cp: context-parallel degree (ranks that share one sequence, each holding a contiguous
            shard), >= 1.
        world_size: number of ranks; must equal dp * cp.

    Raises:
        ValueError: a degree < 1 or dp * cp != world_size (the message names the fields).
    """

    dp: int
    cp: int
    world_size: int
    _mesh: object = field(default=None, init=False, repr=False, compare=False)
    _dp_cp_group: object = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("dp", "cp", "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelDims.{name} must be an integer >= 1, got {value!r}")
        if self.dp * self.cp != self.world_size:
            raise ValueError(
                f"ParallelDims: dp * cp must equal the world size, got dp={self.dp} x cp={self.cp} = "
                f"{self.dp * self.cp} != world_size={self.world_size}"
            )

    @classmethod
    def from_cp(cls, world_size: int, cp: int) -> "ParallelDims":
        """dp = world_size / cp. ValueError (naming parallel.cp) unless cp >= 1 divides world_size."""
        if not isinstance(cp, int) or cp < 1 or world_size % cp:
            raise ValueError(f"parallel.cp={cp} must be >= 1 and divide the world size {world_size}")
        return cls(dp=world_size // cp, cp=cp, world_size=world_size)

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    def coords(self, rank: int) -> tuple[int, int]:
        """(dp_rank, cp_rank) of global ``rank`` (cp inner)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        return rank // self.cp, rank % self.cp

    def build_mesh(self, device_type: str, timeout: timedelta | None = None):
        """The ("dp", "cp") DeviceMesh over all ranks (collective; built once, then cached).

        ``timeout``: the deadline of every collective on the mesh's groups and on
        :attr:`dp_cp_group` (torch gives new groups its 10 / 30 min default, not the world's).

        Raises:
            RuntimeError: torch.distributed is not initialized.
            ValueError: the process group's world size differs from ``world_size``.
        """
        if self._mesh is None:
            if not dist.is_initialized():
                raise RuntimeError("ParallelDims.build_mesh needs an initialized torch.distributed process group")
            if dist.get_world_size() != self.world_size:
                raise ValueError(
                    f"ParallelDims.world_size={self.world_size} but the process group has {dist.get_world_size()} ranks"
                )
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(device_type, (self.dp, self.cp), mesh_dim_names=("dp", "cp"))
            # Made here, not lazily: new_group is collective and every rank must call it in order.
            ranks = sorted(int(r) for r in self._mesh.mesh.flatten().tolist())
            self._dp_cp_group = dist.new_group(ranks=ranks, timeout=timeout)
            if timeout is not None:
                for name in ("dp", "cp"):
                    _set_timeout(self._mesh.get_group(name), timeout)
        return self._mesh

    @property
    def mesh(self):
        """The mesh built by :meth:`build_mesh` (RuntimeError before it)."""
        if self._mesh is None:
            raise RuntimeError("call ParallelDims.build_mesh(device_type) first")
        return self._mesh

    @property
    def cp_group(self):
        """This rank's CP process group (the "cp" axis), or None when cp == 1 or not distributed."""
        if self.cp == 1 or self._mesh is None:
            return None
        return self._mesh.get_group("cp")

    @property
    def dp_group(self):
        """This rank's data-parallel process group (the "dp" axis), or None when not distributed."""
        if self._mesh is None:
            return None
        return self._mesh.get_group("dp")

    @property
    def dp_cp_group(self):
        """A process group over the whole dp x cp mesh (for reductions of replicated parameters'
        gradients and of the loss: both span dp and cp), made by :meth:`build_mesh`; None before."""
        return self._dp_cp_group

    def drain(self) -> None:
        """Collective: a barrier on each group of the mesh (dp, cp, dp x cp), then on the world.

        A barrier waits for its group's earlier work, so afterwards no collective of the run (an
        asynchronous one nobody waited for, as DeepSpeed leaves, included) is still in flight on
        any group: the process can tear down without a worker thread still using it.
        """
        if self._mesh is None:
            return
        for group in (self.dp_group, self.cp_group, self._dp_cp_group, None):
            if group is None or dist.get_world_size(group) > 1:
                dist.barrier(group=group)


@dataclass
class Layout:
    """This process's place in the dp x cp world (cp inner)."""

    rank: int
    world_size: int
    dp: int
    cp: int
    dp_rank: int
    cp_rank: int
    cp_group: object
    device: torch.device
    dims: ParallelDims | None = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def build_layout(world_size: int, rank: int, cp: int, device: torch.device, dims: ParallelDims | None = None) -> Layout:
    """dp x cp layout of ``world_size`` ranks; ValueError unless cp >= 1 divides world_size."""
    dims = dims or ParallelDims.from_cp(world_size, cp)
    dp_rank, cp_rank = dims.coords(rank)
    return Layout(rank, world_size, dims.dp, dims.cp, dp_rank, cp_rank, dims.cp_group, device, dims)


def init_distributed(cfg: ParallelConfig, need_group: bool = False) -> Layout:
    """Initialize torch.distributed from torchrun's environment (or run as one process without it)
    and build the ("dp", "cp") DeviceMesh. ``need_group``: one process without torchrun still gets
    a process group of one rank and the mesh (DeepSpeed needs them)."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("parallel.device=cuda, but this torch build or machine has no CUDA device "
                         "(parallel.device=auto picks the CPU here)")
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if cfg.backend is not None and not use_cuda and cpu_backend(cfg.backend) in (None, "nccl"):
        raise ValueError(f"parallel.backend={cfg.backend} needs CUDA tensors (nccl), but the ranks run on the CPU "
                         f"here (parallel.device={cfg.device}): use parallel.backend=gloo, or null")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    threads = cfg.threads_per_rank or max(1, (os.cpu_count() or 1) // max(local_world, 1))
    torch.set_num_threads(threads)
    if use_cuda and local_rank >= torch.cuda.device_count():
        raise ValueError(f"parallel.device={cfg.device} runs each rank on a GPU of its own, but local rank "
                         f"{local_rank} of {local_world} finds {torch.cuda.device_count()} GPU(s): start at most "
                         "that many processes per node, or pass parallel.device=cpu")
    device = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dims = ParallelDims.from_cp(world_size, cfg.cp)  # ValueError before any process group exists
    if world_size == 1 and not dist.is_initialized() and not need_group:
        return build_layout(1, 0, cfg.cp, device, dims)
    if not dist.is_initialized():
        backend = cfg.backend or ("nccl" if use_cuda else "gloo")
        if "MASTER_ADDR" not in os.environ:  # one process, no launcher: the environment torchrun would set
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                               ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
                os.environ.setdefault(key, value)
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.timeout_s))
    dims = ParallelDims.from_cp(dist.get_world_size(), cfg.cp)
    dims.build_mesh(device.type, timeout=timedelta(seconds=cfg.timeout_s))
    return build_layout(dims.world_size, dist.get_rank(), cfg.cp, device, dims)


def broadcast_object(obj, layout: Layout):
    """Collective: rank 0's ``obj`` on every rank (``obj`` itself when not distributed)."""
    if not layout.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agree(error: str | None, layout: Layout) -> str | None:
    """Collective: the first rank's error message (by rank), or None when no rank has one."""
    if not layout.distributed:
        return error
    box = [None] * layout.world_size
    dist.all_gather_object(box, error)
    return next((e for e in box if e is not None), None)
