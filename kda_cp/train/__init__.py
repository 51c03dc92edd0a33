"""Training a KDA byte-level language model with the sequence sharded over ranks (Hydra + torchrun).

The command line is scripts/train.py (:func:`kda_cp.train.cli.main`); the main job, 2 processes
on CPU, CP = 2, gloo::

    torchrun --nproc_per_node=2 scripts/train.py

Overrides, e.g.: ``parallel.cp=1 trainer.max_steps=100 data.seq_len=1024 model.n_layers=4
data.path=/some/text``. The world of ``torchrun`` is laid out as dp x cp (cp inner: ranks
r*cp .. r*cp+cp-1 share one sequence); ``parallel.cp`` must divide the world size.

The dp x cp layout is a named DeviceMesh (:class:`~kda_cp.train.distributed.ParallelDims`). The
data-parallel side runs either the plain torch path (one flat all-reduce of the gradients over all
ranks) or DeepSpeed ZeRO 1/2/3 (``deepspeed=zero1|zero2|zero3``; both behind
:class:`~kda_cp.train.engine.Engine`); KDA layers under CP run the affine scan
(``parallel.strategy=scan``) or head-parallel Ulysses (``parallel.strategy=ulysses``);
``model.layer_pattern=KKKA`` makes the 3:1 KDA/attention hybrid.

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

Modules: config (schemas, checks), distributed (init, dp x cp mesh, layout), engine (torch and
DeepSpeed engines), optim (AdamW, schedule), trainer (:class:`Trainer`, :func:`train`), metrics
(metrics.jsonl, peak memory, plot), cli (composition, help, one-line errors).
"""

from kda_cp.train.cli import compose_config, main
from kda_cp.train.config import (
    ConfigError,
    DeepSpeedConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    TrainerConfig,
    to_train_config,
)
from kda_cp.train.distributed import Layout, ParallelDims, build_layout, init_distributed
from kda_cp.train.engine import DeepSpeedEngine, Engine, TorchEngine
from kda_cp.train.trainer import Trainer, TrainingStopped, train

__all__ = [
    "ConfigError",
    "DeepSpeedConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "TrainerConfig",
    "TrainingStopped",
    "to_train_config",
    "Layout",
    "ParallelDims",
    "build_layout",
    "init_distributed",
    "Engine",
    "TorchEngine",
    "DeepSpeedEngine",
    "Trainer",
    "train",
    "compose_config",
    "main",
]
