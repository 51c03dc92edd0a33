"""The training config: one dataclass per Hydra group (conf/), the checks made before any process
group exists, and the comparison of a resumed run's config with its checkpoint's.

Every dataclass checks its own values in ``__post_init__`` (ValueError naming ``group.key``);
:func:`to_train_config` turns a composed DictConfig into a checked :class:`TrainConfig` and reports
any failure as a one-line :class:`ConfigError`.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from kda_cp.data import DataConfig
from kda_cp.parallel.layers.context import CP_STRATEGIES, ULYSSES_IMPLS
from kda_cp.model import ModelConfig

__all__ = [
    "ParallelConfig", "OptimConfig", "TrainerConfig", "DeepSpeedConfig", "TrainConfig", "ConfigError",
    "to_train_config", "one_line", "register_configs", "RESUME_SAFE_KEYS", "config_drift", "drift_message",
    "effective_precision", "saved_config",
]


DIST_BACKENDS = ("gloo", "nccl", "mpi", "ucc")


def _backend_spec_ok(spec: str) -> bool:
    """A torch.distributed backend name, or its per-device form "cpu:gloo,cuda:nccl" (nccl not for cpu)."""
    if spec in DIST_BACKENDS:
        return True
    pairs = [p.split(":") for p in spec.split(",")]
    return all(len(p) == 2 and p[0] in ("cpu", "cuda") and p[1] in DIST_BACKENDS for p in pairs) \
        and ["cpu", "nccl"] not in pairs


def cpu_backend(spec: str) -> str | None:
    """The backend a valid spec gives CPU tensors: the name itself, the "cpu:" entry, or None."""
    if ":" not in spec:
        return spec
    return next((p.split(":")[1] for p in spec.split(",") if p.startswith("cpu:")), None)


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
    "ulysses" (head-parallel all-to-all; needs the KDA value heads (num_v_heads, else num_heads)
    and seq_len divisible by cp)."""
    ulysses_impl: str = "auto"
    """All-to-all of the ulysses strategy: "deepspeed" (DistributedAttention), "torch", or "auto"
    (deepspeed when installed)."""

    def __post_init__(self) -> None:
        if isinstance(self.cp, bool) or self.cp < 1:
            raise ValueError(f"parallel.cp must be an int >= 1, got {self.cp}")
        if not self.timeout_s > 0:
            raise ValueError(f"parallel.timeout_s must be > 0 (seconds), got {self.timeout_s}")
        if self.threads_per_rank is not None and (isinstance(self.threads_per_rank, bool) or self.threads_per_rank < 1):
            raise ValueError(f"parallel.threads_per_rank must be >= 1, or null for cpu_count // processes, got "
                             f"{self.threads_per_rank}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"parallel.device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.backend is not None and not _backend_spec_ok(str(self.backend)):
            raise ValueError(f"parallel.backend must be null (nccl with CUDA, else gloo), one of {DIST_BACKENDS} "
                             f"or a per-device list such as 'cpu:gloo,cuda:nccl', got {self.backend!r}")
        if self.strategy not in CP_STRATEGIES:
            raise ValueError(f"parallel.strategy must be one of {CP_STRATEGIES}, got {self.strategy!r}")
        if self.ulysses_impl not in ULYSSES_IMPLS:
            raise ValueError(f"parallel.ulysses_impl must be one of {ULYSSES_IMPLS}, got {self.ulysses_impl!r}")


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
            ("eps", self.eps > 0 and math.isfinite(self.eps), "> 0 and finite"),
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
        for name in ("run_dir", "runs_root"):
            value = getattr(self, name)
            if value is not None and not str(value).strip():
                raise ValueError(f"trainer.{name} must not be empty (it would mean the current directory); "
                                 + ("omit it for an automatic name" if name == "run_dir" else "the default is 'runs'"))


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
            if self.model.kda.v_heads % cp:
                raise ValueError(f"parallel.strategy=ulysses needs the KDA value heads (model.kda.num_v_heads, "
                                 f"else num_heads) % parallel.cp == 0, got {self.model.kda.v_heads} heads, cp={cp}")


class ConfigError(ValueError):
    """A config, input or resume error, raised the same way on every rank: reported once, as one line."""


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (OmegaConf and Hydra spread theirs over several)."""
    text = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
    return text or type(exc).__name__


#: Keys that moved into the nested layer configs: model.<key> -> model.kda.<key> (and
#: model.attention.<key> for the two the attention layers share).
MOVED_MODEL_KEYS = {
    **{f"model.{k}": (f"model.kda.{k}", f"model.attention.{k}") for k in ("num_heads", "head_dim")},
    **{f"model.{k}": (f"model.kda.{k}",) for k in ("conv_size", "g_min", "gate_rank", "chunk_size", "backend",
                                                   "output_gate_rank")},
}


def _unknown_keys(node, schema, prefix: str = "") -> list[str]:
    """Keys of the composed config ``node`` that the dataclass ``schema`` does not declare (e.g.
    ``+trainer.foo=1``, which Hydra adds and OmegaConf.to_object then drops without a word)."""
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


def to_train_config(cfg: TrainConfig | DictConfig) -> TrainConfig:
    """The TrainConfig of a composed DictConfig (checked: no unknown key, every value valid).

    Raises:
        ConfigError: a key the schema does not declare, or a bad value (the message names the key).
    """
    if not isinstance(cfg, DictConfig):
        return cfg
    unknown = _unknown_keys(cfg, TrainConfig)
    if unknown:
        moved = [f"{k} is now {' and '.join(MOVED_MODEL_KEYS[k])}" for k in unknown if k in MOVED_MODEL_KEYS]
        raise ConfigError(f"unknown config key(s): {', '.join(unknown)} (" + "".join(m + "; " for m in moved)
                          + "python scripts/train.py --help lists the groups; each group's keys are the fields of "
                          "its dataclass)")
    try:
        return OmegaConf.to_object(cfg)
    except Exception as exc:  # OmegaConf wraps the dataclasses' ValueError
        cause = exc.__cause__ if isinstance(exc.__cause__, ValueError) else exc
        raise ConfigError(one_line(cause)) from exc


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


#: Keys a resume may change: they steer the loop, the output or the execution, not the function
#: computed (data, model, optimizer, precision, seed and the cp layout must match the checkpoint);
#: segment_len schedules the same recurrence (rounding-level differences only).
RESUME_SAFE_KEYS = (
    "trainer.max_steps", "trainer.val_every", "trainer.log_every", "trainer.checkpoint_every",
    "trainer.keep_checkpoints", "trainer.run_dir", "trainer.runs_root", "trainer.resume", "trainer.progress",
    "trainer.plot", "trainer.peak_tflops", "data.val_batches", "model.kda.backend", "model.kda.segment_len",
    "parallel.backend",
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
    for key, moved_to in MOVED_MODEL_KEYS.items():  # a checkpoint written before the layer configs nested
        if key in old:
            old.update({k: old[key] for k in moved_to})
    if "model.num_heads" in old and "model.norm_eps" in old:  # flat configs: one eps for the blocks and layers
        old["model.kda.norm_eps"] = old["model.norm_eps"]
    return [f"{k} ({old[k]!r} -> {new[k]!r})" for k in sorted(old.keys() & new.keys())
            if k not in RESUME_SAFE_KEYS and old[k] != new[k]]


def effective_precision(precision: str, device_type: str) -> str:
    """What trainer.precision computes in on ``device_type``: "auto" is bf16 on CUDA, fp32 elsewhere."""
    return "bf16" if precision == "bf16" or (precision == "auto" and device_type == "cuda") else "fp32"


def saved_config(cfg: TrainConfig, device_type: str) -> dict:
    """``cfg`` as a checkpoint records it: trainer.precision as computed on ``device_type``."""
    out = asdict(cfg)
    out["trainer"]["precision"] = effective_precision(cfg.trainer.precision, device_type)
    return out


def drift_message(path: Path, saved: dict | None, cfg: TrainConfig, device_type: str) -> str:
    """The refusal of a resume whose config changed keys outside RESUME_SAFE_KEYS, or "".

    trainer.precision is compared as computed: "auto" on a CPU equals "fp32" (a checkpoint that
    recorded "auto" is taken as written on this run's device type)."""
    if saved and isinstance(saved.get("trainer"), dict) and "precision" in saved["trainer"]:
        saved = {**saved, "trainer": {**saved["trainer"],
                                      "precision": effective_precision(saved["trainer"]["precision"], device_type)}}
    drift = config_drift(saved, saved_config(cfg, device_type))
    if not drift:
        return ""
    return (f"trainer.resume: this config differs from that of {path} in keys that change the computation: "
            f"{', '.join(drift)}. Resume with the checkpoint's values (its config.json); only the loop, output "
            "and execution keys may change (kda_cp/train/config.py: RESUME_SAFE_KEYS)")

