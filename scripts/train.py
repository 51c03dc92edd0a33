"""Train a KDA byte-level language model with the sequence sharded over ranks (Hydra + torchrun).

The main job (2 processes on CPU, CP = 2, gloo)::

    torchrun --nproc_per_node=2 scripts/train.py

Overrides, e.g.: ``parallel.cp=1 trainer.max_steps=100 data.seq_len=1024 model.n_layers=4
data.path=/some/text``. The world of ``torchrun`` is laid out as dp x cp (cp inner: ranks
r*cp .. r*cp+cp-1 share one sequence); ``parallel.cp`` must divide the world size.

Loss: the mean over every token of the global batch, i.e. sum of token losses / (batch_size *
seq_len), reduced over dp x cp; each rank back-propagates its share and the gradients are summed
over all ranks. So the CP degree changes the speed, not the numbers.

The dp x cp layout is a named DeviceMesh (kda_cp.parallel.mesh.ParallelDims). The data-parallel
side runs either the plain torch path (one flat all-reduce of the gradients over all ranks) or
DeepSpeed ZeRO 1/2/3 (``deepspeed=zero1|zero2|zero3``, kda_cp.parallel.deepspeed_adapter); KDA
layers under CP run the affine scan (``parallel.strategy=scan``) or head-parallel Ulysses
(``parallel.strategy=ulysses``); ``model.layer_pattern=KKKA`` makes the 3:1 KDA/attention hybrid.

Output, in one run directory shared by all ranks (``trainer.run_dir``, or ``runs/<UTC time>``
chosen on rank 0 and broadcast; only rank 0 writes metadata): ``config.yaml``, ``metrics.jsonl``
(one line per step: step, loss, tokens_per_s, lr, grad_norm, and mfu on GPU; val_loss lines),
``checkpoints/step_N/`` (every ``trainer.checkpoint_every`` steps and at the end, atomic with a
manifest, kda_cp.checkpoint), ``summary.json`` (incl. peak memory) and ``loss.png``.
``trainer.resume=true`` continues from the newest checkpoint that verifies (sizes and sha256) and
loads: model, optimizer, scheduler, step, RNG state; the data order is a function of (data.seed,
step). A checkpoint that fails either is skipped with a warning naming why; none left, or a config
that changed keys outside RESUME_SAFE_KEYS, is an error that changes nothing. ``metrics.jsonl`` is
cut after the resumed step and appended to.

Errors: config keys the schema lacks (also ``+key=value``), bad values and cross-group mismatches
are refused before any process group exists. The command line prints one line per error (once,
from rank 0, when every rank has it) and exits 1; ``KDA_CP_DEBUG=1`` re-raises with the
traceback. ``python scripts/train.py --help`` lists the groups, keys and common overrides.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import resource
import shutil
import socket
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from tqdm import tqdm

import numpy as np

from kda_cp.checkpoint import CheckpointManager, CheckpointWriteError
from kda_cp.data import ByteCorpus, DataConfig, unigram_entropy
from kda_cp.layers import CP_STRATEGIES
from kda_cp.model import KDALanguageModel, ModelConfig, train_flops_per_token
from kda_cp.parallel.deepspeed_adapter import DeepSpeedConfig, DeepSpeedEngineAdapter
from kda_cp.parallel.mesh import ParallelDims

logger = logging.getLogger("kda_cp.train")


# ------------------------------------------------------------------------------------------------
# Configuration
# ------------------------------------------------------------------------------------------------


@dataclass
class ParallelConfig:
    """How the torchrun world is split: cp ranks per sequence, the rest data-parallel."""

    cp: int = 2
    """Context-parallel degree P: ranks that share one sequence (must divide the world size)."""
    backend: str | None = None
    """torch.distributed backend; None means nccl when CUDA is available, else gloo."""
    device: str = "auto"
    """"auto" (cuda when available, else cpu), "cpu" or "cuda"."""
    timeout_s: int = 300
    """Deadline in seconds (> 0) of every collective, on the world group and the dp / cp groups:
    a stuck or dead rank ends the job with an error instead of hanging."""
    threads_per_rank: int | None = None
    """torch CPU threads per process; None means cpu_count // local processes (1 on 2 cores x 2 ranks)."""
    strategy: str = "scan"
    """How KDA layers run on a sharded sequence: "scan" (affine prefix scan over ranks) or
    "ulysses" (head-parallel all-to-all; needs num_heads % cp == 0 and seq_len % cp == 0)."""
    ulysses_impl: str = "auto"
    """All-to-all of the ulysses strategy: "deepspeed" (DistributedAttention), "torch", or "auto"
    (deepspeed when installed)."""

    def __post_init__(self) -> None:
        if isinstance(self.cp, bool) or self.cp < 1:
            raise ValueError(f"parallel.cp must be an int >= 1, got {self.cp}")
        if not self.timeout_s > 0:
            raise ValueError(f"parallel.timeout_s must be > 0 (seconds), got {self.timeout_s}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"parallel.device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.strategy not in CP_STRATEGIES:
            raise ValueError(f"parallel.strategy must be one of {CP_STRATEGIES}, got {self.strategy!r}")
        if self.ulysses_impl not in ("auto", "deepspeed", "torch"):
            raise ValueError(f"parallel.ulysses_impl must be 'auto', 'deepspeed' or 'torch', got {self.ulysses_impl!r}")


@dataclass
class OptimConfig:
    """AdamW with linear warmup and cosine decay."""

    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr (end of the cosine)."""
    warmup_steps: int = 30
    """Linear warmup steps from 0 to lr."""
    weight_decay: float = 0.1
    """Decoupled weight decay of the matrices (not of norms, biases, gate scales)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""

    def __post_init__(self) -> None:
        for name, ok, rule in (
            ("lr", self.lr > 0 and math.isfinite(self.lr), "> 0 and finite"),
            ("min_lr_ratio", 0.0 <= self.min_lr_ratio <= 1.0, "in [0, 1]"),
            ("warmup_steps", self.warmup_steps >= 0, ">= 0"),
            ("weight_decay", self.weight_decay >= 0, ">= 0"),
            ("beta1", 0.0 <= self.beta1 < 1.0, "in [0, 1)"),
            ("beta2", 0.0 <= self.beta2 < 1.0, "in [0, 1)"),
            ("eps", self.eps > 0, "> 0"),
            ("grad_clip", self.grad_clip >= 0, ">= 0 (0 disables)"),
        ):
            if not ok:
                raise ValueError(f"optim.{name} must be {rule}, got {getattr(self, name)}")


@dataclass
class TrainerConfig:
    """Loop length, evaluation, logging and output."""

    max_steps: int = 200
    """Optimizer steps."""
    val_every: int = 100
    """Evaluate on the validation split every N steps (and always at the end); 0: only at the end."""
    log_every: int = 25
    """Log a metrics line to the logger every N steps (metrics.jsonl gets every step)."""
    checkpoint_every: int = 0
    """Write a checkpoint every N steps (0: only at the end)."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept in <run_dir>/checkpoints (>= 1; 2 keeps a fallback)."""
    run_dir: str | None = None
    """Run directory; None means <runs_root>/<UTC timestamp>, chosen on rank 0."""
    runs_root: str = "runs"
    """Parent of the automatically named run directories."""
    resume: bool = False
    """Resume from the newest complete checkpoint in <run_dir>/checkpoints (needs run_dir)."""
    seed: int = 0
    """Seed of the model initialization (identical on every rank)."""
    progress: bool = True
    """Show a tqdm progress bar on rank 0."""
    plot: bool = True
    """Write loss.png into the run directory at the end (needs matplotlib)."""
    precision: str = "auto"
    """"fp32", "bf16" (torch.autocast to bfloat16; weights, optimizer and loss stay fp32), or
    "auto": bf16 on CUDA, fp32 on CPU."""
    peak_tflops: float = 989.0
    """Peak dense throughput per GPU for MFU (989 TFLOP/s: H200/H100 SXM bf16 dense)."""

    def __post_init__(self) -> None:
        if self.precision not in ("auto", "fp32", "bf16"):
            raise ValueError(f"trainer.precision must be 'auto', 'fp32' or 'bf16', got {self.precision!r}")
        for name, least in (("max_steps", 1), ("log_every", 1), ("val_every", 0), ("checkpoint_every", 0)):
            if getattr(self, name) < least:
                raise ValueError(f"trainer.{name} must be >= {least}, got {getattr(self, name)}")
        if not self.peak_tflops > 0:
            raise ValueError(f"trainer.peak_tflops must be > 0, got {self.peak_tflops}")
        if self.keep_checkpoints < 1:
            raise ValueError(f"trainer.keep_checkpoints must be >= 1, got {self.keep_checkpoints}")


@dataclass
class TrainConfig:
    """Root config: one field per config group of conf/."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)

    def __post_init__(self) -> None:
        cp, T = self.parallel.cp, self.data.seq_len
        if T < cp:
            raise ValueError(f"data.seq_len={T} is too short for parallel.cp={cp}: every CP rank needs at least "
                             f"one token of each sequence (seq_len >= cp)")
        if self.parallel.strategy == "ulysses" and cp > 1:
            if T % cp:
                raise ValueError(f"parallel.strategy=ulysses needs data.seq_len % parallel.cp == 0, "
                                 f"got seq_len={T}, cp={cp}")
            if self.model.num_heads % cp:
                raise ValueError(f"parallel.strategy=ulysses needs model.num_heads % parallel.cp == 0, "
                                 f"got num_heads={self.model.num_heads}, cp={cp}")


class ConfigError(ValueError):
    """A config, input or resume error, raised the same way on every rank: reported once, as one line."""


def _unknown_keys(node, schema, prefix: str = "") -> list[str]:
    """Keys of the composed config ``node`` that the dataclass ``schema`` does not declare (e.g.
    ``+trainer.foo=1``, which Hydra adds and OmegaConf.to_object then drops without a word)."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(schema)
    names = {f.name for f in dataclasses.fields(schema)}
    out = []
    for key in node.keys():
        full = f"{prefix}{key}"
        if key not in names:
            out.append(full)
        elif dataclasses.is_dataclass(hints.get(key)) and isinstance(node.get(key), DictConfig):
            out.extend(_unknown_keys(node[key], hints[key], full + "."))
    return out


def to_train_config(cfg: "TrainConfig | DictConfig") -> "TrainConfig":
    """The TrainConfig of a composed DictConfig (checked: no unknown key, every value valid).

    Raises:
        ConfigError: a key the schema does not declare, or a bad value (the message names the key).
    """
    if not isinstance(cfg, DictConfig):
        return cfg
    unknown = _unknown_keys(cfg, TrainConfig)
    if unknown:
        raise ConfigError(f"unknown config key(s): {', '.join(unknown)} (python scripts/train.py --help lists the groups; "
                          "each group's keys are the fields of its dataclass)")
    try:
        return OmegaConf.to_object(cfg)
    except Exception as exc:  # OmegaConf wraps the dataclasses' ValueError
        cause = exc.__cause__ if isinstance(exc.__cause__, ValueError) else exc
        raise ConfigError(_one_line(cause)) from exc


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line (OmegaConf and Hydra spread theirs over several)."""
    text = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
    return text or type(exc).__name__


def register_configs() -> None:
    """Register the schemas in Hydra's ConfigStore (conf/*.yaml only compose them)."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(group="model", name="schema", node=ModelConfig)
    cs.store(group="data", name="schema", node=DataConfig)
    cs.store(group="parallel", name="schema", node=ParallelConfig)
    cs.store(group="optim", name="schema", node=OptimConfig)
    cs.store(group="trainer", name="schema", node=TrainerConfig)
    cs.store(group="deepspeed", name="schema", node=DeepSpeedConfig)


register_configs()


# ------------------------------------------------------------------------------------------------
# Distributed layout
# ------------------------------------------------------------------------------------------------


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
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    threads = cfg.threads_per_rank or max(1, (os.cpu_count() or 1) // max(local_world, 1))
    torch.set_num_threads(threads)
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


def _broadcast_object(obj, layout: Layout):
    if not layout.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ------------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------------


def lr_lambda(cfg: OptimConfig, max_steps: int):
    """Multiplier of the peak lr at a step: linear warmup, then cosine down to min_lr_ratio."""

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def _autocast(layout: Layout, precision: str):
    """bf16 autocast on CUDA (trainer.precision auto or bf16); fp32 otherwise."""
    bf16 = precision == "bf16" or (precision == "auto" and layout.device.type == "cuda")
    if not bf16:
        return nullcontext()
    return torch.autocast(device_type=layout.device.type, dtype=torch.bfloat16)


def _loss_sum(model, x, y, layout: Layout, cfg: TrainConfig) -> torch.Tensor:
    with _autocast(layout, cfg.trainer.precision):
        logits = model(
            x.to(layout.device),
            cp_group=layout.cp_group,
            cp_strategy=cfg.parallel.strategy,
            ulysses_impl=cfg.parallel.ulysses_impl,
        )
    return F.cross_entropy(logits.flatten(0, 1).float(), y.to(layout.device).flatten(), reduction="sum")


@torch.no_grad()
def evaluate(model, corpus: ByteCorpus, layout: Layout, cfg: TrainConfig) -> float:
    """Mean validation loss (nats/byte) over the fixed validation batches, reduced over all ranks."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=layout.device)
    for i in range(corpus.num_val_batches()):
        x, y = corpus.val_batch(i, layout.dp_rank, layout.dp, layout.cp_rank, layout.cp)
        total[0] += _loss_sum(model, x, y, layout, cfg).double()
        total[1] += y.numel()
    if layout.distributed:
        dist.all_reduce(total)
    model.train()
    return float(total[0] / total[1])


def _sync_grads_and_loss(params: list[torch.Tensor], loss_sum: torch.Tensor, layout: Layout) -> float:
    """Sum every rank's gradients (one flat all-reduce, the loss sum riding along); return the summed loss."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = _flatten_dense_tensors(grads + [loss_sum.detach().reshape(1).to(grads[0].dtype)])
    if layout.distributed:
        dist.all_reduce(flat)
    for p, g in zip(params, _unflatten_dense_tensors(flat[:-1], grads)):
        p.grad = g
    return float(flat[-1])


class TorchEngine:
    """The plain torch data-parallel path (DeepSpeed off), with the interface of
    :class:`kda_cp.parallel.deepspeed_adapter.DeepSpeedEngineAdapter`: gradients summed over all
    dp x cp ranks in one flat all-reduce, global-norm clipping, AdamW, scheduler."""

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

    def reduce(self, loss_sum: torch.Tensor) -> float:
        """All-reduce the gradients with the loss sum riding along; returns the global loss sum."""
        return _sync_grads_and_loss(self.params, loss_sum, self.layout)

    def step(self) -> float:
        if self.grad_clip > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip))
        else:
            norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.params])))
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
        return state


class DeepSpeedEngine(DeepSpeedEngineAdapter):
    """DeepSpeed ZeRO with the TorchEngine interface: the loss sum is all-reduced on its own
    (DeepSpeed reduces the gradients inside backward/step)."""

    def __init__(self, *args, layout: Layout, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.layout = layout

    def reduce(self, loss_sum: torch.Tensor) -> float:
        total = loss_sum.detach().reshape(1).clone()
        if self.layout.distributed:
            dist.all_reduce(total)
        return float(total)


def _rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA allocator peak on GPU; the process's max resident set size on CPU (ru_maxrss, KiB on Linux)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _plot(run_dir: Path, history: list[dict], entropy: float) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.info("matplotlib not installed: no loss.png")
        return None
    train = [(m["step"], m["loss"]) for m in history if "loss" in m]
    val = [(m["step"], m["val_loss"]) for m in history if "val_loss" in m]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if train:
        ax.plot(*zip(*train), lw=0.8, label="train loss")
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.axhline(entropy, color="gray", ls="--", label=f"unigram entropy {entropy:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("nats / byte")
    ax.set_title("KDA byte LM on the Python stdlib")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = run_dir / "loss.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _resolve_run_dir(cfg: TrainerConfig, layout: Layout) -> Path:
    """The run directory (chosen on rank 0, broadcast), not yet created: :func:`train` makes it
    just before the first step, so a run that fails earlier leaves nothing behind. A fresh run
    (trainer.resume=false) refuses a directory that already holds a run's checkpoints or metrics,
    which it would overwrite.

    Raises:
        ConfigError: on every rank, when a fresh run is pointed at a used run directory, or run_dir is a file.
    """
    run_dir, error = cfg.run_dir, ""
    if layout.rank == 0:
        if run_dir is None:  # unique even when two runs start within the same second
            stamp = str(Path(cfg.runs_root) / datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"))
            run_dir, n = stamp, 0
            while Path(run_dir).exists():
                n += 1
                run_dir = f"{stamp}-{n}"
        elif Path(run_dir).exists() and not Path(run_dir).is_dir():
            error = f"trainer.run_dir must be a directory (or not exist yet), not a file: {run_dir}"
        elif not cfg.resume:
            ckpt_dir, metrics = Path(run_dir) / "checkpoints", Path(run_dir) / "metrics.jsonl"
            if (ckpt_dir.is_dir() and any(ckpt_dir.iterdir())) or (metrics.is_file() and metrics.stat().st_size):
                error = (f"trainer.run_dir={run_dir} already holds a run (checkpoints or metrics.jsonl) that a fresh "
                         "run would overwrite: pass trainer.resume=true to continue it, or choose a new trainer.run_dir")
    run_dir, error = _broadcast_object((run_dir, error), layout)
    if error:
        raise ConfigError(error)
    return Path(run_dir)


def _agree(error: str | None, layout: Layout) -> str | None:
    """Collective: the first rank's error message (by rank), or None when no rank has one."""
    if not layout.distributed:
        return error
    box = [None] * layout.world_size
    dist.all_gather_object(box, error)
    return next((e for e in box if e is not None), None)


#: Keys a resume may change: they steer the loop, the output or the execution, not the function
#: computed (data, model, optimizer, precision, seed and the cp layout must match the checkpoint).
RESUME_SAFE_KEYS = (
    "trainer.max_steps", "trainer.val_every", "trainer.log_every", "trainer.checkpoint_every",
    "trainer.keep_checkpoints", "trainer.run_dir", "trainer.runs_root", "trainer.resume", "trainer.progress",
    "trainer.plot", "trainer.peak_tflops", "data.val_batches", "model.backend", "parallel.backend",
    "parallel.device", "parallel.timeout_s", "parallel.threads_per_rank", "parallel.strategy",
    "parallel.ulysses_impl", "deepspeed.reduce_bucket_size", "deepspeed.allgather_bucket_size",
    "deepspeed.overlap_comm", "deepspeed.contiguous_gradients", "deepspeed.param_persistence_threshold",
)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_drift(saved: dict | None, current: dict) -> list[str]:
    """The keys (outside RESUME_SAFE_KEYS) whose values differ between a checkpoint's config and
    this run's, as "key (saved -> now)"; keys present on one side only are not compared."""
    if not saved:
        return []
    old, new = _flatten(saved), _flatten(current)
    return [f"{k} ({old[k]!r} -> {new[k]!r})" for k in sorted(old.keys() & new.keys())
            if k not in RESUME_SAFE_KEYS and old[k] != new[k]]


def _drift_message(path: Path, saved: dict | None, cfg: TrainConfig) -> str:
    """The refusal of a resume whose config changed keys outside RESUME_SAFE_KEYS, or ""."""
    drift = config_drift(saved, asdict(cfg))
    if not drift:
        return ""
    return (f"trainer.resume: this config differs from that of {path} in keys that change the computation: "
            f"{', '.join(drift)}. Resume with the checkpoint's values (its config.json); only the loop, output "
            "and execution keys may change (scripts/train.py: RESUME_SAFE_KEYS)")


def _resume(engine, ckpts: CheckpointManager, layout: Layout, cfg: TrainConfig) -> int:
    """Load the newest checkpoint that verifies and loads on every rank; returns its step.

    A checkpoint that fails verification (rank 0: sizes and sha256) or fails to load on any rank
    (missing file, failed unpickle, ...) is skipped with a warning naming the reason, and the one
    before it is tried.

    Raises:
        ConfigError: on every rank: no valid checkpoint (nothing in the run directory is changed),
            a checkpoint past trainer.max_steps or of another world size, or a config that differs
            from the checkpoint's in keys that change the computation.
    """
    before, skipped = None, []
    while True:
        found, why = None, ""
        if layout.rank == 0:
            found = ckpts.latest(before)
            skipped += ckpts.skipped
            if found is not None:
                saved_ranks = len(list(found.path.glob("rng_rank*.pt")))
                if found.step > cfg.trainer.max_steps:
                    why = (f"trainer.resume: the newest checkpoint {found.path} is at step {found.step}, past "
                           f"trainer.max_steps={cfg.trainer.max_steps}: raise max_steps to continue it")
                elif saved_ranks != layout.world_size:
                    why = (f"trainer.resume: {found.path} was written by {saved_ranks} ranks, this run has "
                           f"{layout.world_size}: resume with the same torchrun --nproc_per_node and parallel.cp")
                elif (found.path / "config.json").is_file():  # checked before loading: a new shape would not load
                    why = _drift_message(found.path, json.loads((found.path / "config.json").read_text()), cfg)
        found, why, skipped = _broadcast_object((found, why, skipped), layout)
        if why:
            raise ConfigError(why)
        if found is None:
            detail = "; ".join(skipped) if skipped else "no checkpoint was written"
            raise ConfigError(f"trainer.resume=true: no valid checkpoint in {ckpts.root} ({detail}); nothing was "
                              "changed. Restore a checkpoint, or start a fresh run with a new trainer.run_dir")
        error = None
        try:
            client = engine.load(found.path)
            rng = torch.load(found.path / f"rng_rank{layout.rank}.pt", weights_only=False)
        except Exception as exc:
            error = f"{found.path.name}: rank {layout.rank}: {type(exc).__name__}: {_one_line(exc)}"
        error = _agree(error, layout)
        if error is None:
            break
        if layout.rank == 0:
            logger.warning("checkpoint %s could not be loaded (%s): using an earlier one", found.path, error)
        skipped.append(error)
        before = found.step
    why = _drift_message(found.path, client.get("config"), cfg)  # checkpoints without config.json
    if why:
        raise ConfigError(why)
    _set_rng_state(rng, layout.device)
    if layout.rank == 0:
        logger.info("resumed from %s at step %d", found.path, int(client["step"]))
    return int(client["step"])


def _continue_metrics(path: Path, step: int) -> list[dict]:
    """Keep metrics.jsonl's records up to ``step`` and cut the file after them, so that it goes on
    by appending. A torn last line (a crash mid-write) and the records past ``step`` (steps run
    after the checkpoint) are dropped, with a warning for the torn line. Returns the kept records."""
    if not path.is_file():
        return []
    data = path.read_bytes()
    kept, end, pos = [], 0, 0
    for raw in data.splitlines(keepends=True):
        if raw.strip():
            try:
                rec = json.loads(raw)
                rec_step = int(rec["step"])
            except (ValueError, KeyError, TypeError):
                logger.warning("%s: dropping an unreadable line at byte %d and what follows (torn by a crash): %r",
                               path, pos, raw[:80])
                break
            if rec_step > step:
                break
            kept.append(rec)
        pos += len(raw)
        end = pos
    with open(path, "r+b") as fh:
        fh.truncate(end)
        if end and not data[:end].endswith(b"\n"):  # a complete last record that lost its newline
            fh.seek(end)
            fh.write(b"\n")
    return kept


def train(cfg: TrainConfig | DictConfig) -> dict:
    """Run training; returns the summary dict (also written to summary.json on rank 0).

    Args:
        cfg: a TrainConfig, or a DictConfig of its schema (checked by :func:`to_train_config`).

    Raises:
        ConfigError (a ValueError), on every rank: an unknown key or bad value, parallel.cp does
            not divide the world size, an unreadable data.path, trainer.resume without
            trainer.run_dir or without a valid checkpoint, a config that drifted from the
            checkpoint's, a fresh run in a run directory that holds another run.
        CheckpointWriteError: writing a checkpoint failed (e.g. a full disk), on every rank.
        FloatingPointError: the loss became NaN/Inf (on every rank at the same step).
    """
    cfg = to_train_config(cfg)
    if cfg.trainer.resume and cfg.trainer.run_dir is None:
        raise ConfigError("trainer.resume=true needs trainer.run_dir (the run to continue)")
    t_start, cpu_start = time.perf_counter(), time.process_time()
    try:
        layout = init_distributed(cfg.parallel, need_group=cfg.deepspeed.enabled)
    except ValueError as exc:  # parallel.cp and the world size, parallel.device=cuda without CUDA
        raise ConfigError(str(exc)) from exc
    if layout.rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    if cfg.data.batch_size % layout.dp:
        raise ConfigError(f"data.batch_size={cfg.data.batch_size} must be divisible by the data-parallel degree "
                          f"dp = world size {layout.world_size} / parallel.cp {layout.cp} = {layout.dp}")
    is_main = layout.rank == 0
    try:
        corpus = ByteCorpus(cfg.data)
    except (OSError, ValueError) as exc:  # the same files on every rank: the same error everywhere
        raise ConfigError(_one_line(exc) if "data." in str(exc) else f"data.path={cfg.data.path!r}: {_one_line(exc)}") from exc
    run_dir = _resolve_run_dir(cfg.trainer, layout)
    entropy = unigram_entropy(corpus.data)
    torch.manual_seed(cfg.trainer.seed)
    model = KDALanguageModel(cfg.model).to(layout.device)
    if layout.distributed:  # identical init everywhere, whatever the RNG did
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)
    n_params = model.num_params()
    flops_per_token = train_flops_per_token(model, cfg.data.seq_len)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.optim, cfg.trainer.max_steps))
    if cfg.deepspeed.enabled:
        engine = DeepSpeedEngine(
            model, optimizer, scheduler, layout.dims or ParallelDims(1, 1, 1), cfg.deepspeed,
            micro_batch=cfg.data.batch_size // layout.dp, grad_clip=cfg.optim.grad_clip, layout=layout,
        )
    else:
        engine = TorchEngine(model, optimizer, scheduler, layout, cfg.optim.grad_clip)

    barrier = dist.barrier if layout.distributed else (lambda: None)
    ckpts = CheckpointManager(run_dir, layout.rank, barrier, keep=cfg.trainer.keep_checkpoints,
                              agree=lambda error: _agree(error, layout))
    start_step = _resume(engine, ckpts, layout, cfg) if cfg.trainer.resume else 0

    def save(step: int) -> None:
        def write(tmp: Path) -> None:
            engine.save(tmp, {"step": step, "config": asdict(cfg)})
            if is_main:  # read on resume before the weights, to refuse a changed config
                (tmp / "config.json").write_text(json.dumps(asdict(cfg), indent=1) + "\n")
            torch.save(_rng_state(layout.device), tmp / f"rng_rank{layout.rank}.pt")

        ckpts.save(step, write)

    # Everything is in place: the run directory is made (or continued) only now.
    created = is_main and not run_dir.exists()
    history: list[dict] = []
    metrics_path = run_dir / "metrics.jsonl"
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        logger.info(
            "run dir %s; world %d = dp %d x cp %d on %s; strategy %s; %s",
            run_dir, layout.world_size, layout.dp, layout.cp, layout.device, cfg.parallel.strategy,
            f"DeepSpeed ZeRO-{cfg.deepspeed.stage}" if cfg.deepspeed.enabled else "torch data parallel",
        )
        logger.info(
            "model: %d parameters, %.3g training FLOPs/token; corpus unigram entropy %.4f nats/byte",
            n_params, flops_per_token, entropy,
        )
        if start_step:  # the history of the run being continued, up to its checkpoint
            history = _continue_metrics(metrics_path, start_step)
    metrics_file = open(metrics_path, "a") if is_main else None

    def record(entry: dict) -> None:
        history.append(entry)
        if metrics_file is not None:
            metrics_file.write(json.dumps(entry) + "\n")
            metrics_file.flush()

    global_tokens = cfg.data.batch_size * cfg.data.seq_len
    n_gpus = layout.world_size if layout.device.type == "cuda" else 0
    val_loss = float("nan")
    bar = tqdm(
        total=cfg.trainer.max_steps,
        initial=start_step,
        disable=not (is_main and cfg.trainer.progress),
        dynamic_ncols=True,
        desc="train",
    )
    train_time, tok_rates, mfus = 0.0, [], []
    engine.train()
    try:
        for step in range(start_step, cfg.trainer.max_steps):
            t0 = time.perf_counter()
            x, y = corpus.train_batch(step, layout.dp_rank, layout.dp, layout.cp_rank, layout.cp)
            loss_sum = _loss_sum(engine, x, y, layout, cfg)
            engine.backward(loss_sum / global_tokens)
            loss = engine.reduce(loss_sum) / global_tokens
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {step}")
            lr = engine.lr
            grad_norm = engine.step()
            if layout.device.type == "cuda":
                torch.cuda.synchronize(layout.device)
            dt = time.perf_counter() - t0
            train_time += dt
            tok_s = global_tokens / dt
            entry = {"step": step + 1, "loss": loss, "tokens_per_s": tok_s, "lr": lr, "grad_norm": grad_norm}
            if n_gpus:
                entry["mfu"] = tok_s * flops_per_token / (n_gpus * cfg.trainer.peak_tflops * 1e12)
                mfus.append(entry["mfu"])
            tok_rates.append(tok_s)
            record(entry)
            created = False  # a step is recorded: the run directory stays whatever happens next
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:.0f}", **({"mfu": f"{entry['mfu']:.1%}"} if n_gpus else {}))
            bar.update(1)
            done = step + 1
            if is_main and (done % cfg.trainer.log_every == 0 or done == 1):
                logger.info("step %d loss %.4f tokens/s %.0f lr %.2e", done, loss, tok_s, lr)
            if cfg.trainer.val_every and done % cfg.trainer.val_every == 0 and done < cfg.trainer.max_steps:
                val_loss = evaluate(engine, corpus, layout, cfg)
                record({"step": done, "val_loss": val_loss})
                if is_main:
                    logger.info("step %d val_loss %.4f (unigram entropy %.4f)", done, val_loss, entropy)
            if cfg.trainer.checkpoint_every and done % cfg.trainer.checkpoint_every == 0 and done < cfg.trainer.max_steps:
                save(done)
        bar.close()
        val_loss = evaluate(engine, corpus, layout, cfg)
        record({"step": cfg.trainer.max_steps, "val_loss": val_loss})
        save(cfg.trainer.max_steps)
    except BaseException:
        if metrics_file is not None:
            metrics_file.close()
            metrics_file = None
        if created:  # failed before its first step: leave no empty run directory behind
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    finally:
        bar.close()
        if metrics_file is not None:
            metrics_file.close()

    peak = torch.tensor([peak_memory_bytes(layout.device)], dtype=torch.float64, device=layout.device)
    if layout.distributed:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    summary = {
        "val_loss": val_loss,
        "unigram_entropy": entropy,
        "steps": cfg.trainer.max_steps,
        "start_step": start_step,  # > 0 after a resume; tokens, times and rates count this invocation only
        "tokens": global_tokens * (cfg.trainer.max_steps - start_step),
        "train_time_s": train_time,
        "wall_time_s": time.perf_counter() - t_start,
        "cpu_time_s_rank0": time.process_time() - cpu_start,
        "median_tokens_per_s": float(np.median(tok_rates)) if tok_rates else float("nan"),
        "median_mfu": float(np.median(mfus)) if mfus else None,
        "train_flops_per_token": flops_per_token,
        "peak_memory_gib": float(peak) / 2**30,
        "peak_memory_kind": "cuda max_memory_allocated" if layout.device.type == "cuda" else "max RSS",
        "world_size": layout.world_size,
        "dp": layout.dp,
        "cp": layout.cp,
        "strategy": cfg.parallel.strategy,
        "zero_stage": cfg.deepspeed.stage,
        "params": n_params,
        "run_dir": str(run_dir),
    }
    if is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if cfg.trainer.plot:
            _plot(run_dir, history, entropy)
        logger.info(
            "final: validation loss %.4f nats/byte | corpus unigram entropy %.4f nats/byte (steps %d-%d in %.0f s) | "
            "median %.0f tokens/s%s | peak memory %.2f GiB (%s)",
            val_loss, entropy, start_step + 1, cfg.trainer.max_steps, summary["wall_time_s"], summary["median_tokens_per_s"],
            f", MFU {summary['median_mfu']:.1%}" if mfus else "", summary["peak_memory_gib"], summary["peak_memory_kind"],
        )
    return summary


CONF_DIR = Path(__file__).resolve().parents[1] / "conf"

USAGE = """\
usage: [torchrun --nproc_per_node=N] python scripts/train.py [--help] [--cfg] [KEY=VALUE | GROUP=OPTION ...]

Train a KDA (Kimi Delta Attention) byte-level language model with the sequence sharded over the
ranks of torchrun (context parallelism), the rest of the world data-parallel. Without torchrun it
runs as one process. Arguments are Hydra overrides of the config in conf/; a key that the config
does not declare is an error, also with a leading '+'.

Config groups (GROUP=OPTION picks a file of conf/GROUP/):
{groups}

Keys and their defaults:
{keys}

Common overrides:
  parallel.cp=N                  ranks per sequence (divides the world size; the rest is data-parallel)
  trainer.max_steps=N            optimizer steps; data.seq_len=N, data.batch_size=N (global, in sequences)
  data.path=FILE_OR_DIR          train on other text (default: the Python standard library's sources)
  model.layer_pattern=KKKA model.n_layers=4    the 3:1 KDA / attention hybrid (n_layers a multiple)
  deepspeed=zero1|zero2|zero3    DeepSpeed ZeRO; parallel.strategy=ulysses: head-parallel all-to-all
  trainer.run_dir=DIR trainer.checkpoint_every=N   where outputs go, checkpoint cadence
  trainer.run_dir=DIR trainer.resume=true         continue a run from its newest valid checkpoint
  +experiment=h200_hybrid_64k    the one-H200 hybrid at 64k context

Options:
  --help, -h    this text
  --cfg         print the composed config and exit

Outputs: <run_dir>/config.yaml, metrics.jsonl, checkpoints/step_N/, summary.json, loss.png.
Errors print one line on stderr (from rank 0 when every rank has the same error) and exit with
status 1; set KDA_CP_DEBUG=1 for the Python traceback.
"""


def _help_text() -> str:
    import dataclasses

    groups = []
    for d in sorted(p for p in CONF_DIR.iterdir() if p.is_dir()):
        options = sorted(f.stem for f in d.glob("*.yaml"))
        prefix = "+" if d.name == "experiment" else ""
        groups.append(f"  {prefix}{d.name}: {' | '.join(options)}")
    keys = []
    for f in dataclasses.fields(TrainConfig):
        schema = f.default_factory()
        items = " ".join(f"{x.name}={getattr(schema, x.name)!r}".replace("'", "") for x in dataclasses.fields(schema))
        keys.append(f"  {f.name}: {items}")
    import textwrap

    keys = ["\n".join(textwrap.wrap(k, 100, subsequent_indent="      ")) for k in keys]
    return USAGE.format(groups="\n".join(groups), keys="\n".join(keys))


def compose_config(overrides: list[str]) -> DictConfig:
    """Compose conf/config.yaml with Hydra overrides (the command line's KEY=VALUE arguments).

    Raises:
        ConfigError: an override Hydra cannot parse or apply (the message is Hydra's, on one line).
    """
    from hydra import compose, initialize_config_dir

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="train"):
            return compose(config_name="config", overrides=list(overrides))
    except Exception as exc:
        raise ConfigError(_one_line(exc)) from exc


def main(argv: list[str] | None = None) -> int:
    """The command line (see USAGE); returns the exit status: 0, or 1 after printing one error line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print(_help_text())
        return 0
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    debug = os.environ.get("KDA_CP_DEBUG", "") not in ("", "0")
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    status = 0
    try:
        show = "--cfg" in argv
        cfg = compose_config([a for a in argv if a != "--cfg"])
        if show:
            to_train_config(cfg)
            print(OmegaConf.to_yaml(cfg))
            return 0
        summary = train(cfg)
        if rank == 0:
            print(
                f"validation loss {summary['val_loss']:.4f} nats/byte | "
                f"corpus unigram entropy {summary['unigram_entropy']:.4f} nats/byte"
            )
        if dist.is_initialized():
            dist.barrier()  # no rank tears down while another's collectives are still in flight
    except Exception as exc:
        if debug:
            raise
        # Raised alike on every rank: rank 0 reports it. Anything else may be one rank's own.
        shared = isinstance(exc, (ConfigError, CheckpointWriteError, FloatingPointError))
        if rank == 0 or not shared:
            who = "" if shared or world == 1 else f"rank {rank}: "
            name = "" if isinstance(exc, (ConfigError, CheckpointWriteError)) else f"{type(exc).__name__}: "
            print(f"error: {who}{name}{_one_line(exc)}", file=sys.stderr, flush=True)
        status = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
