"""The command line of training (scripts/train.py): Hydra composition of conf/, ``--help``,
``--cfg``, and errors as one line on stderr with exit status 1 (``KDA_CP_DEBUG=1`` re-raises)."""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import os
import sys
import textwrap
import time
from pathlib import Path
from typing import NoReturn

import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from kda_cp.checkpoint import CheckpointWriteError
from kda_cp.train.config import MOVED_MODEL_KEYS, ConfigError, TrainConfig, one_line, to_train_config
from kda_cp.train.trainer import TrainingStopped, train

__all__ = ["CONF_DIR", "USAGE", "help_text", "compose_config", "main", "exit_process"]


CONF_DIR = Path(__file__).resolve().parents[2] / "conf"  # the repository's conf/

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


def help_text() -> str:
    """USAGE with the config groups of conf/ and every schema key with its default."""
    groups = []
    for d in sorted(p for p in CONF_DIR.iterdir() if p.is_dir()):
        options = sorted(f.stem for f in d.glob("*.yaml"))
        prefix = "+" if d.name == "experiment" else ""
        groups.append(f"  {prefix}{d.name}: {' | '.join(options)}")
    def items(obj, prefix=""):  # nested configs (model.kda, model.attention) as dotted keys
        for x in dataclasses.fields(obj):
            value = getattr(obj, x.name)
            if dataclasses.is_dataclass(value):
                yield from items(value, f"{prefix}{x.name}.")
            else:
                yield f"{prefix}{x.name}={value!r}".replace("'", "")

    keys = [f"  {f.name}: {' '.join(items(f.default_factory()))}" for f in dataclasses.fields(TrainConfig)]
    keys = ["\n".join(textwrap.wrap(k, 100, subsequent_indent="      ")) for k in keys]
    return USAGE.format(groups="\n".join(groups), keys="\n".join(keys))


def _bool_keys(cls=TrainConfig, prefix: str = "") -> set[str]:
    """Dotted keys of the config's bool fields (the schema's dataclasses, recursively)."""
    keys = set()
    for f in dataclasses.fields(cls):
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            keys |= _bool_keys(type(default), f"{prefix}{f.name}.")
        elif kind == "bool":
            keys.add(f"{prefix}{f.name}")
    return keys


def compose_config(overrides: list[str]) -> DictConfig:
    """Compose conf/config.yaml with Hydra overrides (the command line's KEY=VALUE arguments).

    Raises:
        ConfigError: an override Hydra cannot parse or apply (the message is Hydra's, on one line),
            or a key that moved into a nested config (the message names its new place).
    """
    bools = _bool_keys()
    for override in overrides:
        if override in ("--multirun", "-m"):
            raise ConfigError("sweeps (--multirun) are not supported: run one configuration per command")
        key, _, value = override.lstrip("+~").partition("=")
        if key.startswith("hydra.") or key == "hydra":
            raise ConfigError(f"{override!r}: Hydra's own settings are not used here (no Hydra output directory "
                              "or logging); the run directory is trainer.run_dir")
        if key in MOVED_MODEL_KEYS:
            raise ConfigError(f"{key} is now {' and '.join(MOVED_MODEL_KEYS[key])} (the layers' configs nest in "
                              f"the model's): got {override!r}")
        # Hydra takes any nonzero int (and yes/on) for a bool: trainer.resume=4 would resume the newest
        # checkpoint, not step 4
        if key in bools and value.strip().lower() not in ("true", "false"):
            raise ConfigError(f"{key} must be true or false, got {value!r}" + (
                " (a resume always takes the newest complete checkpoint; to resume an earlier step, move the "
                "later ones out of checkpoints/)" if key == "trainer.resume" else ""))
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="train"):
            return compose(config_name="config", overrides=list(overrides))
    except Exception as exc:
        text, cause = one_line(exc), exc.__cause__  # Hydra's "Error merging override" keeps the reason in its cause
        if cause is not None and one_line(cause) not in text:
            text = f"{text}: {one_line(cause)}"
        if "LexerNoViableAlt" in text:  # Hydra's grammar takes no ~, space and the like unquoted
            text += " (quote such a value inside the override: 'trainer.run_dir=\"~/my run\"')"
        raise ConfigError(text) from exc


SHARED_ERROR_WAIT_S = 30  # how long a rank other than 0 waits for rank 0 to print a shared error
_RAN_DISTRIBUTED = False  # main() tore down a process group: exit_process skips interpreter finalization


def main(argv: list[str] | None = None) -> int:
    """The command line (see USAGE); returns the exit status: 0, or 1 after printing one error line."""
    global _RAN_DISTRIBUTED
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not faulthandler.is_enabled():
        try:  # a fatal signal (an abort in a C++ thread) prints every thread's Python stack
            faulthandler.enable()
        except (OSError, ValueError):  # a stderr without a file descriptor (captured)
            pass
    debug = os.environ.get("KDA_CP_DEBUG", "") not in ("", "0")
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    status = 0
    try:
        show = "--cfg" in argv
        cfg = compose_config([a for a in argv if a != "--cfg"])
        if show:
            print(OmegaConf.to_yaml(OmegaConf.structured(to_train_config(cfg))))  # nested d_model filled in
            return 0
        summary = train(cfg)
        if rank == 0:
            print(
                f"validation loss {summary['val_loss']:.4f} nats/byte | "
                f"corpus unigram entropy {summary['unigram_entropy']:.4f} nats/byte"
            )
    except TrainingStopped as exc:  # on every rank at the same step: rank 0 reports it
        if rank == 0:
            print(f"stopped: {exc}", file=sys.stderr, flush=True)
        status = 128 + exc.signum  # as a process ended by that signal reports itself to a shell
    except Exception as exc:
        if debug:
            raise
        # Raised alike on every rank: rank 0 reports it. Anything else may be one rank's own.
        shared = isinstance(exc, (ConfigError, CheckpointWriteError, FloatingPointError))
        name = "" if isinstance(exc, (ConfigError, CheckpointWriteError)) else f"{type(exc).__name__}: "
        who = "" if (shared and rank == 0) or world == 1 else f"rank {rank}: "
        if shared and rank != 0:
            # Rank 0 reports this error; exiting first would let torchrun stop rank 0 before it prints.
            # torchrun ends this wait as soon as rank 0 exits; a rank still here after it reports
            # the error itself (rank 0 did not raise it, or another launcher runs the ranks).
            time.sleep(SHARED_ERROR_WAIT_S)
        print(f"error: {who}{name}{one_line(exc)}", file=sys.stderr, flush=True)
        status = 1
    finally:
        if dist.is_initialized():
            _RAN_DISTRIBUTED = True
            dist.destroy_process_group()
    return status


def exit_process(status: int, *, distributed: bool | None = None) -> NoReturn:
    """End the process with ``status`` once training has returned (scripts/train.py).

    After torch.distributed ran (``distributed``; None: :func:`main` tore down a process group), the
    process leaves through ``os._exit`` once stdio and logging are flushed: process groups still
    referenced (by the DeviceMesh, by DeepSpeed) keep gloo's worker threads alive into interpreter
    finalization, which can abort a finished run ("terminate called without an active exception",
    exit status -6). Every file of the run is closed by then.
    """
    if not (_RAN_DISTRIBUTED if distributed is None else distributed):
        sys.exit(status)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()
    os._exit(status)
