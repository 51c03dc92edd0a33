"""DeepSpeed ZeRO (stages 1, 2, 3) for the data-parallel side of a dp x cp run: the one adapter.

Everything DeepSpeed-specific lives here; scripts/train.py sees :class:`DeepSpeedConfig` (a Hydra
config group, ``deepspeed=none|zero1|zero2|zero3``) and :class:`DeepSpeedEngineAdapter`.

How CP stays orthogonal to ZeRO. Every parameter is replicated over the whole dp x cp mesh (CP
shards activations, not weights), and its gradient is the SUM of the gradients of all dp * cp ranks
(each rank back-propagates sum of its token losses / global token count). So the group over which
ZeRO reduces gradients and partitions optimizer state (stage 1), gradients (stage 2) and parameters
(stage 3) is the flattened dp x cp group: :class:`MeshMPU` hands DeepSpeed that group as its
"data-parallel" group, a size-1 model-parallel group, and no sequence-parallel group. DeepSpeed
averages the reduced gradients over that group's size, so :meth:`DeepSpeedEngineAdapter.backward`
scales the loss by dp * cp to turn the average back into the sum. Result: a run with cp = c and
dp = d takes the same update as one process on the same global batch (tests/test_train_scale.py).

Why not DeepSpeed's own sequence-parallel groups (mpu with get_sequence_parallel_group = the cp
axis, data-parallel = the dp axis)? With DeepSpeed 0.19.8 that path reduces over dp x sp in ZeRO 1
and 2, but ZeRO-3 reduced over the dp axis only: on a 4-rank gloo run (dp 2 x cp 2) the ranks
reported different global grad norms after the first step. The flattened group gives identical
numbers for all three stages.

CPU: DeepSpeed picks its CPU accelerator when no GPU is present (or with DS_ACCELERATOR=cpu). Its
default CPU communication backend is oneCCL; here the torch.distributed process group (gloo) is made
first and DeepSpeed wraps it. DeepSpeed JIT-builds a small shared-memory op on first use
(~/.cache/torch_extensions; needs a C++ compiler).

Checkpoints: ``engine.save_checkpoint`` / ``load_checkpoint`` (model, ZeRO-partitioned optimizer
state, lr scheduler, per-rank files) into a directory that :class:`kda_cp.checkpoint.CheckpointManager`
makes atomic.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from kda_cp.parallel.mesh import ParallelDims

__all__ = ["DeepSpeedConfig", "MeshMPU", "DeepSpeedEngineAdapter", "build_ds_config"]

logger = logging.getLogger(__name__)

_TAG = "deepspeed"


@dataclass
class DeepSpeedConfig:
    """DeepSpeed ZeRO settings (conf/deepspeed/*.yaml)."""

    stage: int = 0
    """ZeRO stage: 0 means DeepSpeed off (the plain torch path), 1 optimizer state, 2 + gradients,
    3 + parameters partitioned over the dp x cp ranks."""
    reduce_bucket_size: int = 50_000_000
    """Elements per gradient reduction bucket."""
    allgather_bucket_size: int = 50_000_000
    """Elements per all-gather bucket (stages 1, 2)."""
    overlap_comm: bool = False
    """Overlap gradient reduction with backward (GPU streams; keep off on CPU)."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced (stages 2, 3)."""
    param_persistence_threshold: int = 100_000
    """Stage 3: parameters with fewer elements stay unpartitioned (0 partitions every parameter)."""

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"deepspeed.stage must be 0 (off), 1, 2 or 3, got {self.stage!r}")
        for name in ("reduce_bucket_size", "allgather_bucket_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"deepspeed.{name} must be >= 1, got {getattr(self, name)}")
        if self.param_persistence_threshold < 0:
            raise ValueError(f"deepspeed.param_persistence_threshold must be >= 0, got {self.param_persistence_threshold}")

    @property
    def enabled(self) -> bool:
        return self.stage > 0


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


class DeepSpeedEngineAdapter:
    """A DeepSpeed engine driven like the plain torch path of scripts/train.py.

    Args:
        model, optimizer, scheduler: the torch module, its torch optimizer and LR scheduler
            (DeepSpeed wraps the optimizer and steps the scheduler after every optimizer step).
        dims: the ParallelDims whose mesh is built.
        cfg: a DeepSpeedConfig with stage 1, 2 or 3.
        micro_batch: sequences per rank per step (for DeepSpeed's batch bookkeeping).
        grad_clip: global gradient-norm clipping (0: off).

    Raises:
        ValueError: cfg.stage == 0.
        ImportError: deepspeed is not installed.
    """

    def __init__(self, model, optimizer, scheduler, dims: ParallelDims, cfg: DeepSpeedConfig, *, micro_batch: int, grad_clip: float):
        if not cfg.enabled:
            raise ValueError("DeepSpeedEngineAdapter needs deepspeed.stage in (1, 2, 3)")
        import deepspeed

        self.world = dims.world_size
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

    def step(self) -> float:
        """Optimizer step (clipping inside) and scheduler step; returns the global grad norm before clipping."""
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    @property
    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def save(self, path: Path, client_state: dict) -> None:
        """Collective: DeepSpeed's per-rank checkpoint files under ``path`` (made atomic by the caller)."""
        self.engine.save_checkpoint(str(path), tag=_TAG, client_state=client_state, save_latest=False)

    def load(self, path: Path) -> dict:
        """Collective: restore model, optimizer and scheduler; returns the client state."""
        load_path, client_state = self.engine.load_checkpoint(
            str(path), tag=_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if load_path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {path}")
        return client_state
