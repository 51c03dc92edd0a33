"""The training engine: one interface (:class:`Engine`) over the model, optimizer and scheduler,
with two implementations for the data-parallel side of a dp x cp run.

- :class:`TorchEngine` (``deepspeed=none``): gradients summed over all dp x cp ranks in one flat
  all-reduce (the loss sum riding along), global-norm clipping, AdamW, scheduler.
- :class:`DeepSpeedEngine` (``deepspeed=zero1|zero2|zero3``): DeepSpeed ZeRO stages 1, 2, 3. All
  DeepSpeed-specific code lives here.

How CP stays orthogonal to ZeRO. Every parameter is replicated over the whole dp x cp mesh (CP
shards activations, not weights), and its gradient is the SUM of the gradients of all dp * cp ranks
(each rank back-propagates sum of its token losses / global token count). So the group over which
ZeRO reduces gradients and partitions optimizer state (stage 1), gradients (stage 2) and parameters
(stage 3) is the flattened dp x cp group: :class:`MeshMPU` hands DeepSpeed that group as its
"data-parallel" group, a size-1 model-parallel group, and no sequence-parallel group. DeepSpeed
averages the reduced gradients over that group's size, so :meth:`DeepSpeedEngine.backward` scales
the loss by dp * cp to turn the average back into the sum. Result: a run with cp = c and dp = d
takes the same update as one process on the same global batch (tests/train/test_train_scale.py).

Why not DeepSpeed's own sequence-parallel groups (mpu with get_sequence_parallel_group = the cp
axis, data-parallel = the dp axis)? With DeepSpeed 0.19.8 that path reduces over dp x sp in ZeRO 1
and 2, but ZeRO-3 reduced over the dp axis only: on a 4-rank gloo run (dp 2 x cp 2) the ranks
reported different global grad norms after the first step. The flattened group gives identical
numbers for all three stages.

CPU: DeepSpeed picks its CPU accelerator when no GPU is present (or with DS_ACCELERATOR=cpu). Its
default CPU communication backend is oneCCL; here the torch.distributed process group (gloo) is made
first and DeepSpeed wraps it. DeepSpeed JIT-builds a small shared-memory op on first use
(~/.cache/torch_extensions; needs a C++ compiler).

Checkpoints: each engine's ``save`` / ``load`` writes into and reads from a directory that
:class:`kda_cp.checkpoint.CheckpointManager` makes atomic (TorchEngine: rank 0's ``state.pt``;
DeepSpeed: ``engine.save_checkpoint``'s per-rank files, ZeRO-partitioned optimizer state included).
"""

from __future__ import annotations

import abc
import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from kda_cp.train.config import DeepSpeedConfig
from kda_cp.train.distributed import Layout, ParallelDims
from kda_cp.train.optim import sync_lr

__all__ = ["Engine", "TorchEngine", "DeepSpeedEngine", "MeshMPU", "build_ds_config", "build_engine"]

_TAG = "deepspeed"


class Engine(abc.ABC):
    """Model, optimizer and scheduler driven as one: forward, backward, gradient reduction, step,
    checkpoint. Every rank calls the methods in the same order: ``reduce`` is collective, and under
    DeepSpeed so are ``backward``, ``step``, ``save`` and ``load``."""

    module: torch.nn.Module

    @abc.abstractmethod
    def __call__(self, *args, **kwargs):
        """The model's forward."""

    @abc.abstractmethod
    def train(self) -> None:
        """Training mode."""

    @abc.abstractmethod
    def eval(self) -> None:
        """Evaluation mode."""

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate this rank's share of the global mean loss."""

    @abc.abstractmethod
    def reduce(self, loss_sum: torch.Tensor, stop: bool = False) -> tuple[float, bool]:
        """(the global loss sum, whether any rank asks to ``stop``): all ranks' ``loss_sum`` added,
        the stop flags riding along in the same all-reduce; the torch path reduces the gradients with them."""

    @abc.abstractmethod
    def step(self) -> float:
        """Optimizer step (clipping inside) and scheduler step; returns the global grad norm before clipping."""

    @property
    @abc.abstractmethod
    def lr(self) -> float:
        """The learning rate of the next step."""

    @abc.abstractmethod
    def save(self, path: Path, client_state: dict) -> None:
        """Write model, optimizer, scheduler and ``client_state`` under ``path`` (made atomic by the caller)."""

    @abc.abstractmethod
    def load(self, path: Path) -> dict:
        """Restore model, optimizer and scheduler from ``path``; returns the client state."""


def _sync_grads_and_loss(params: list[torch.Tensor], loss_sum: torch.Tensor, stop: bool,
                         layout: Layout) -> tuple[float, bool]:
    """Sum every rank's gradients (one flat all-reduce, the loss sum and the stop flag riding
    along); return the summed loss and whether any rank stops."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    tail = torch.stack([loss_sum.detach().reshape(()).to(grads[0].dtype), grads[0].new_tensor(float(stop))])
    flat = _flatten_dense_tensors(grads + [tail])
    if layout.distributed:
        dist.all_reduce(flat)
    for p, g in zip(params, _unflatten_dense_tensors(flat[:-2], grads)):
        p.grad = g
    loss, stops = flat[-2:].tolist()
    return loss, stops > 0


class TorchEngine(Engine):
    """The plain torch data-parallel path (DeepSpeed off): gradients summed over all dp x cp ranks
    in one flat all-reduce, global-norm clipping, AdamW, scheduler."""

    def __init__(self, model, optimizer, scheduler, layout: Layout, grad_clip: float) -> None:
        self.module, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.layout, self.grad_clip = layout, grad_clip
        self.params = [p for p in model.parameters() if p.requires_grad]

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def reduce(self, loss_sum: torch.Tensor, stop: bool = False) -> tuple[float, bool]:
        """All-reduce the gradients with the loss sum and the stop flag riding along."""
        return _sync_grads_and_loss(self.params, loss_sum, stop, self.layout)

    def step(self) -> float:
        """The norm is that of the all-reduced gradients, the same on every rank; a non-finite one
        (NaN or Inf gradients) skips the update, so the weights stay those before the step."""
        if self.grad_clip > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip))
        else:
            norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.params])))
        if math.isfinite(norm):
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def save(self, path: Path, client_state: dict) -> None:
        if self.layout.rank == 0:  # every rank holds the same replicated state
            state = {
                "model": self.module.state_dict(),
                "optim": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                **client_state,
            }
            torch.save(state, path / "state.pt")

    def load(self, path: Path) -> dict:
        state = torch.load(path / "state.pt", map_location=self.layout.device, weights_only=False)
        self.module.load_state_dict(state.pop("model"))
        self.optimizer.load_state_dict(state.pop("optim"))
        self.scheduler.load_state_dict(state.pop("scheduler"))
        sync_lr(self.optimizer, self.scheduler)
        return state


class MeshMPU:
    """The "model parallel unit" DeepSpeed asks for its groups, answered from a dp x cp mesh.

    Data parallel (ZeRO's reduction and partition group) = all dp * cp ranks of the mesh; model
    parallel = this rank alone. See the module docstring for why cp is folded into it.
    """

    def __init__(self, dims: ParallelDims) -> None:
        self.dims = dims
        self._dp_cp = dims.dp_cp_group
        if self._dp_cp is None:
            raise RuntimeError("MeshMPU needs ParallelDims.build_mesh() first")
        self._ranks = [dist.get_global_rank(self._dp_cp, r) for r in range(dist.get_world_size(self._dp_cp))]
        # new_subgroups is collective: every rank makes all singleton groups and keeps its own.
        self._solo, _ = dist.new_subgroups(group_size=1)

    def get_data_parallel_group(self):
        return self._dp_cp

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self._dp_cp)

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self._dp_cp)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self._ranks)

    def get_model_parallel_group(self):
        return self._solo

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0


def build_ds_config(cfg: DeepSpeedConfig, *, micro_batch: int, grad_clip: float) -> dict:
    """The DeepSpeed JSON config: fp32 (bf16 comes from torch autocast in the trainer), one
    micro-batch per step, ZeRO ``cfg.stage``, clipping at ``grad_clip`` (0: off)."""
    zero = {
        "stage": cfg.stage,
        "reduce_bucket_size": cfg.reduce_bucket_size,
        "overlap_comm": cfg.overlap_comm,
        "contiguous_gradients": cfg.contiguous_gradients,
    }
    if cfg.stage in (1, 2):
        zero["allgather_bucket_size"] = cfg.allgather_bucket_size
    if cfg.stage == 3:
        zero["stage3_param_persistence_threshold"] = cfg.param_persistence_threshold
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # the client AdamW (torch.optim.AdamW)
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


class DeepSpeedEngine(Engine):
    """DeepSpeed ZeRO over the flattened dp x cp group (see the module docstring).

    Args:
        model, optimizer, scheduler: the torch module, its torch optimizer and LR scheduler
            (DeepSpeed wraps the optimizer and steps the scheduler after every optimizer step).
        layout: this process's Layout; its ParallelDims' mesh is built.
        cfg: a DeepSpeedConfig with stage 1, 2 or 3.
        micro_batch: sequences per rank per step (for DeepSpeed's batch bookkeeping).
        grad_clip: global gradient-norm clipping (0: off).

    Raises:
        ValueError: cfg.stage == 0.
        ImportError: deepspeed is not installed.
    """

    def __init__(self, model, optimizer, scheduler, layout: Layout, cfg: DeepSpeedConfig, *, micro_batch: int,
                 grad_clip: float) -> None:
        if not cfg.enabled:
            raise ValueError("DeepSpeedEngine needs deepspeed.stage in (1, 2, 3)")
        import deepspeed

        dims = layout.dims or ParallelDims(1, 1, 1)
        self.layout, self.world = layout, dims.world_size
        self.engine, _, _, _ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            mpu=MeshMPU(dims),
            config=build_ds_config(cfg, micro_batch=micro_batch, grad_clip=grad_clip),
            dist_init_required=False,
        )
        self.module = self.engine.module

    def __call__(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def train(self) -> None:
        self.engine.train()

    def eval(self) -> None:
        self.engine.eval()

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate this rank's share of the global mean loss; scaled by dp * cp because
        DeepSpeed averages the reduced gradients over its data-parallel (here dp x cp) group."""
        self.engine.backward(loss * self.world)

    def reduce(self, loss_sum: torch.Tensor, stop: bool = False) -> tuple[float, bool]:
        """The loss sum and the stop flag all-reduced on their own (DeepSpeed reduces the gradients
        inside backward/step)."""
        total = torch.stack([loss_sum.detach().reshape(()), loss_sum.new_tensor(float(stop))])
        if self.layout.distributed:
            dist.all_reduce(total)
        loss, stops = total.tolist()
        return loss, stops > 0

    def step(self) -> float | None:
        """DeepSpeed's global gradient norm of the step, None where it reports none."""
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else None

    @property
    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def save(self, path: Path, client_state: dict) -> None:
        """Collective: DeepSpeed's per-rank checkpoint files under ``path``."""
        self.engine.save_checkpoint(str(path), tag=_TAG, client_state=client_state, save_latest=False)

    def load(self, path: Path) -> dict:
        """Collective: restore model, optimizer and scheduler; returns the client state."""
        load_path, client_state = self.engine.load_checkpoint(
            str(path), tag=_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if load_path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {path}")
        sync_lr(self.engine.optimizer, self.engine.lr_scheduler)
        return client_state


def build_engine(model, optimizer, scheduler, layout: Layout, cfg: DeepSpeedConfig, *, micro_batch: int,
                 grad_clip: float) -> Engine:
    """DeepSpeedEngine when ``cfg.enabled`` (deepspeed.stage 1-3), else TorchEngine."""
    if cfg.enabled:
        return DeepSpeedEngine(model, optimizer, scheduler, layout, cfg, micro_batch=micro_batch, grad_clip=grad_clip)
    return TorchEngine(model, optimizer, scheduler, layout, grad_clip)
