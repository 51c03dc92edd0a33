"""Train a KDA byte-level language model with the sequence sharded over ranks (Hydra + torchrun).

The main job (2 processes on CPU, CP = 2, gloo)::

    torchrun --nproc_per_node=2 scripts/train.py

Overrides, e.g.: ``parallel.cp=1 trainer.max_steps=100 data.seq_len=1024 model.n_layers=4
data.path=/some/text``. The world of ``torchrun`` is laid out as dp x cp (cp inner: ranks
r*cp .. r*cp+cp-1 share one sequence); ``parallel.cp`` must divide the world size.

Loss: the mean over every token of the global batch, i.e. sum of token losses / (batch_size *
seq_len), reduced over dp x cp; each rank back-propagates its share and the gradients are summed
over all ranks. So the CP degree changes the speed, not the numbers.

Output, in one run directory shared by all ranks (``trainer.run_dir``, or ``runs/<UTC time>``
chosen on rank 0 and broadcast; only rank 0 writes): ``config.yaml``, ``metrics.jsonl`` (one line
per step: step, loss, tokens_per_s, lr; and val_loss lines), ``checkpoint.pt`` (written atomically),
``summary.json`` and ``loss.png`` (when matplotlib is installed).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from tqdm import tqdm

from kda_cp.data import ByteCorpus, DataConfig, unigram_entropy
from kda_cp.model import KDALanguageModel, ModelConfig

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
    """Timeout of every collective (init_process_group): a stuck rank fails instead of hanging."""
    threads_per_rank: int | None = None
    """torch CPU threads per process; None means cpu_count // local processes (1 on 2 cores x 2 ranks)."""


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
    """Write the checkpoint every N steps (0: only at the end)."""
    run_dir: str | None = None
    """Run directory; None means <runs_root>/<UTC timestamp>, chosen on rank 0."""
    runs_root: str = "runs"
    """Parent of the automatically named run directories."""
    resume: bool = False
    """Resume from <run_dir>/checkpoint.pt when it exists (needs run_dir)."""
    seed: int = 0
    """Seed of the model initialization (identical on every rank)."""
    progress: bool = True
    """Show a tqdm progress bar on rank 0."""
    plot: bool = True
    """Write loss.png into the run directory at the end (needs matplotlib)."""


@dataclass
class TrainConfig:
    """Root config: one field per config group of conf/."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def register_configs() -> None:
    """Register the schemas in Hydra's ConfigStore (conf/*.yaml only compose them)."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(group="model", name="schema", node=ModelConfig)
    cs.store(group="data", name="schema", node=DataConfig)
    cs.store(group="parallel", name="schema", node=ParallelConfig)
    cs.store(group="optim", name="schema", node=OptimConfig)
    cs.store(group="trainer", name="schema", node=TrainerConfig)


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

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def build_layout(world_size: int, rank: int, cp: int, device: torch.device, cp_group=None) -> Layout:
    """dp x cp layout of ``world_size`` ranks; ValueError unless cp >= 1 divides world_size."""
    if cp < 1 or world_size % cp:
        raise ValueError(f"parallel.cp={cp} must be >= 1 and divide the world size {world_size}")
    return Layout(rank, world_size, world_size // cp, cp, rank // cp, rank % cp, cp_group, device)


def init_distributed(cfg: ParallelConfig) -> Layout:
    """Initialize torch.distributed from torchrun's environment (or run as one process without it)."""
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    threads = cfg.threads_per_rank or max(1, (os.cpu_count() or 1) // max(local_world, 1))
    torch.set_num_threads(threads)
    device = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if cfg.cp < 1 or world_size % cfg.cp:
        raise ValueError(f"parallel.cp={cfg.cp} must be >= 1 and divide the world size {world_size}")
    if world_size == 1 and not dist.is_initialized():
        return build_layout(1, 0, cfg.cp, device)
    if not dist.is_initialized():
        backend = cfg.backend or ("nccl" if use_cuda else "gloo")
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.timeout_s))
    world_size, rank = dist.get_world_size(), dist.get_rank()
    dp = world_size // cfg.cp
    mesh = torch.distributed.device_mesh.init_device_mesh(
        device.type, (dp, cfg.cp), mesh_dim_names=("dp", "cp")
    )
    cp_group = mesh.get_group("cp") if cfg.cp > 1 else None
    return build_layout(world_size, rank, cfg.cp, device, cp_group)


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


def _loss_sum(model, x, y, layout: Layout) -> torch.Tensor:
    logits = model(x.to(layout.device), cp_group=layout.cp_group)
    return F.cross_entropy(logits.flatten(0, 1).float(), y.to(layout.device).flatten(), reduction="sum")


@torch.no_grad()
def evaluate(model, corpus: ByteCorpus, layout: Layout) -> float:
    """Mean validation loss (nats/byte) over the fixed validation batches, reduced over all ranks."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=layout.device)
    for i in range(corpus.num_val_batches()):
        x, y = corpus.val_batch(i, layout.dp_rank, layout.dp, layout.cp_rank, layout.cp)
        total[0] += _loss_sum(model, x, y, layout).double()
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


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


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
    run_dir = cfg.run_dir
    if run_dir is None and layout.rank == 0:
        run_dir = str(Path(cfg.runs_root) / datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"))
    run_dir = Path(_broadcast_object(run_dir, layout))
    if layout.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def train(cfg: TrainConfig | DictConfig) -> dict:
    """Run training; returns the summary dict (also written to summary.json on rank 0).

    Args:
        cfg: a TrainConfig, or a DictConfig of its schema (converted once with OmegaConf.to_object).

    Raises:
        ValueError: parallel.cp does not divide the world size, trainer.resume without
            trainer.run_dir, or a bad config value.
        FloatingPointError: the loss became NaN/Inf (on every rank at the same step).
    """
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_object(cfg)
    if cfg.trainer.resume and cfg.trainer.run_dir is None:
        raise ValueError("trainer.resume=true needs trainer.run_dir (the run to continue)")
    t_start, cpu_start = time.perf_counter(), time.process_time()
    layout = init_distributed(cfg.parallel)
    if layout.rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    run_dir = _resolve_run_dir(cfg.trainer, layout)
    is_main = layout.rank == 0
    if is_main:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        logger.info("run dir %s; world %d = dp %d x cp %d on %s", run_dir, layout.world_size, layout.dp, layout.cp, layout.device)

    corpus = ByteCorpus(cfg.data)
    entropy = unigram_entropy(corpus.data)
    torch.manual_seed(cfg.trainer.seed)
    model = KDALanguageModel(cfg.model).to(layout.device)
    if layout.distributed:  # identical init everywhere, whatever the RNG did
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.optim, cfg.trainer.max_steps))
    params = [p for p in model.parameters() if p.requires_grad]
    if is_main:
        logger.info("model: %d parameters; corpus unigram entropy %.4f nats/byte", model.num_params(), entropy)

    ckpt_path = run_dir / "checkpoint.pt"
    start_step = 0
    if cfg.trainer.resume and ckpt_path.exists():
        state = torch.load(ckpt_path, map_location=layout.device, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        scheduler.load_state_dict(state["scheduler"])
        start_step = state["step"]
        if is_main:
            logger.info("resumed from %s at step %d", ckpt_path, start_step)

    def save(step: int) -> None:
        if is_main:
            _atomic_save(
                {
                    "model": model.state_dict(),
                    "optim": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "step": step,
                    "config": asdict(cfg),
                },
                ckpt_path,
            )

    metrics_file = open(run_dir / "metrics.jsonl", "a") if is_main else None
    history: list[dict] = []

    def record(entry: dict) -> None:
        history.append(entry)
        if metrics_file is not None:
            metrics_file.write(json.dumps(entry) + "\n")
            metrics_file.flush()

    global_tokens = cfg.data.batch_size * cfg.data.seq_len
    val_loss = float("nan")
    bar = tqdm(
        total=cfg.trainer.max_steps,
        initial=start_step,
        disable=not (is_main and cfg.trainer.progress),
        dynamic_ncols=True,
        desc="train",
    )
    train_time = 0.0
    model.train()
    try:
        for step in range(start_step, cfg.trainer.max_steps):
            t0 = time.perf_counter()
            x, y = corpus.train_batch(step, layout.dp_rank, layout.dp, layout.cp_rank, layout.cp)
            optimizer.zero_grad(set_to_none=True)
            loss_sum = _loss_sum(model, x, y, layout)
            (loss_sum / global_tokens).backward()
            loss = _sync_grads_and_loss(params, loss_sum, layout) / global_tokens
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {step}")
            if cfg.optim.grad_clip > 0:
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip))
            else:
                grad_norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            scheduler.step()
            dt = time.perf_counter() - t0
            train_time += dt
            tok_s = global_tokens / dt
            record({"step": step + 1, "loss": loss, "tokens_per_s": tok_s, "lr": lr, "grad_norm": grad_norm})
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:.0f}")
            bar.update(1)
            done = step + 1
            if is_main and (done % cfg.trainer.log_every == 0 or done == 1):
                logger.info("step %d loss %.4f tokens/s %.0f lr %.2e", done, loss, tok_s, lr)
            if cfg.trainer.val_every and done % cfg.trainer.val_every == 0 and done < cfg.trainer.max_steps:
                val_loss = evaluate(model, corpus, layout)
                record({"step": done, "val_loss": val_loss})
                if is_main:
                    logger.info("step %d val_loss %.4f (unigram entropy %.4f)", done, val_loss, entropy)
            if cfg.trainer.checkpoint_every and done % cfg.trainer.checkpoint_every == 0:
                save(done)
        bar.close()
        val_loss = evaluate(model, corpus, layout)
        record({"step": cfg.trainer.max_steps, "val_loss": val_loss})
        save(cfg.trainer.max_steps)
    finally:
        bar.close()
        if metrics_file is not None:
            metrics_file.close()

    summary = {
        "val_loss": val_loss,
        "unigram_entropy": entropy,
        "steps": cfg.trainer.max_steps,
        "tokens": global_tokens * (cfg.trainer.max_steps - start_step),
        "train_time_s": train_time,
        "wall_time_s": time.perf_counter() - t_start,
        "cpu_time_s_rank0": time.process_time() - cpu_start,
        "world_size": layout.world_size,
        "dp": layout.dp,
        "cp": layout.cp,
        "params": model.num_params(),
        "run_dir": str(run_dir),
    }
    if is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if cfg.trainer.plot:
            _plot(run_dir, history, entropy)
        logger.info(
            "final: validation loss %.4f nats/byte | corpus unigram entropy %.4f nats/byte (%d steps, %.0f s)",
            val_loss,
            entropy,
            cfg.trainer.max_steps,
            summary["wall_time_s"],
        )
    return summary


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        summary = train(cfg)
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                f"validation loss {summary['val_loss']:.4f} nats/byte | "
                f"corpus unigram entropy {summary['unigram_entropy']:.4f} nats/byte"
            )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
