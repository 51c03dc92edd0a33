"""The training loop: :class:`Trainer` builds a run from a TrainConfig (layout, corpus, model,
engine, checkpoints, resume), then steps, evaluates and checkpoints it; :func:`train` runs one.

Loss: the mean over every token of the global batch, i.e. sum of token losses / (batch_size *
seq_len), reduced over dp x cp; each rank back-propagates its share and the gradients are summed
over all ranks. So the CP degree changes the speed, not the numbers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import shutil
import signal
import socket
import threading
import time
from contextlib import nullcontext
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from kda_cp.checkpoint import CheckpointManager
from kda_cp.data import ByteCorpus, unigram_entropy
from kda_cp.model import KDALanguageModel, train_flops_per_token
from kda_cp.parallel.layers.context import CPContext, parallelize
from kda_cp.train.config import (ConfigError, TrainConfig, TrainerConfig, drift_message, effective_precision, one_line,
                                 saved_config, to_train_config)
from kda_cp.train.distributed import Layout, agree, broadcast_object, init_distributed
from kda_cp.train.engine import build_engine
from kda_cp.train.metrics import MetricsLog, peak_memory_bytes, plot_losses
from kda_cp.train.optim import build_optimizer, build_scheduler

__all__ = ["Trainer", "train"]

logger = logging.getLogger("kda_cp.train")


def _autocast(device: torch.device, precision: str):
    """bf16 autocast on CUDA (trainer.precision auto or bf16); fp32 otherwise."""
    if effective_precision(precision, device.type) != "bf16":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


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


#: Files a run writes at the top of its run directory (a fresh run refuses a directory holding any).
RUN_FILES = ("config.yaml", "summary.json", "loss.png")


class RunDirLock:
    """``<run_dir>/.lock``: an exclusive flock held by the main rank of the run that writes the
    directory, so that a second run (two fresh runs given one trainer.run_dir, or a resume while
    the run still goes) is refused instead of interleaving checkpoints and metrics. The kernel
    drops the lock when its process ends, however it ends, so a killed run never blocks the next
    one. The file stays (it holds the last holder's pid and host, for the refusal's message);
    deleting it while held would let a second run lock a new file. An advisory lock: it excludes
    runs on one host, and across hosts where the filesystem supports flock."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / ".lock"
        self._fh = None

    def acquire(self) -> str | None:
        """Take the lock; returns None, or why not (another run holds it)."""
        import fcntl

        fh = open(self.path, "a+")
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held by a live process
            fh.seek(0)
            holder = fh.read().strip() or "unknown"
            fh.close()
            return (f"trainer.run_dir={self.path.parent} is being written by another run ({holder}; lock "
                    f"{self.path}): wait for it to end, or choose another trainer.run_dir")
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} on {socket.gethostname()}")
        fh.flush()
        self._fh = fh
        return None

    def release(self) -> None:
        if self._fh is not None:
            self._fh.close()  # closing the file drops the flock
            self._fh = None


class TrainingStopped(Exception):
    """SIGTERM or SIGINT stopped the run at a step boundary, on every rank, after its checkpoint
    was saved; ``trainer.resume=true`` continues it."""

    def __init__(self, signum: int, step: int, path: Path) -> None:
        self.signum, self.step, self.path = signum, step, path
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}: checkpoint {path} saved; "
                         "continue with trainer.resume=true")


class StopSignals:
    """While :meth:`Trainer.fit` runs (main thread only): SIGTERM and SIGINT are noted instead of
    ending the process, and the training loop stops at the next step boundary on every rank
    together (the flag rides in the step's all-reduce) after saving that step. A preempted job or
    a Ctrl-C keeps its last step. The third signal acts at once, as without this."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: int | None = None
        self._count, self._previous = 0, {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    def _note(self, signum, frame) -> None:
        self._count += 1
        if self.received is None:
            self.received = signum
            logger.warning("%s received: stopping after this step, once its checkpoint is saved (a third "
                           "signal stops at once)", signal.Signals(signum).name)
        if self._count >= 3:
            self.__exit__()
            signal.raise_signal(signum)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def corpus_digest(data: np.ndarray) -> dict:
    """What a checkpoint records of the corpus it was trained on: its size and sha256."""
    return {"bytes": int(data.size), "sha256": hashlib.sha256(np.ascontiguousarray(data).tobytes()).hexdigest()}


def _used_by_a_run(run_dir: Path) -> str:
    """Why a fresh run must not write ``run_dir`` (it holds a run's checkpoints or metrics, or a
    file of RUN_FILES, which it would overwrite), or "" when it may."""
    ckpt_dir, metrics = run_dir / "checkpoints", run_dir / "metrics.jsonl"
    if (ckpt_dir.is_dir() and any(ckpt_dir.iterdir())) or (metrics.is_file() and metrics.stat().st_size):
        return (f"trainer.run_dir={run_dir} already holds a run (checkpoints or metrics.jsonl) that a fresh "
                "run would overwrite: pass trainer.resume=true to continue it, or choose a new trainer.run_dir")
    if ckpt_dir.exists() and not ckpt_dir.is_dir():
        return f"trainer.run_dir={run_dir}: {ckpt_dir} is a file; checkpoints are written into that directory"
    taken = [n for n in RUN_FILES if (run_dir / n).exists()]  # never overwrite what someone else put there
    if taken == ["config.yaml"] and (run_dir / ".lock").is_file() and metrics.is_file():
        taken = []  # what a run killed before its first step leaves (with an empty metrics.jsonl): reusable
    if taken:
        return (f"trainer.run_dir={run_dir} already holds {', '.join(taken)}, which a fresh run would "
                "overwrite: choose a new trainer.run_dir (or trainer.resume=true to continue a run)")
    return ""


def _resolve_run_dir(cfg: TrainerConfig, layout: Layout) -> Path:
    """The run directory (chosen on rank 0, broadcast), not yet created: :meth:`Trainer.fit` makes
    it just before the first step, so a run that fails earlier leaves nothing behind. A fresh run
    (trainer.resume=false) refuses a directory that already holds a run's checkpoints or metrics,
    or one of RUN_FILES, which it would overwrite.

    Raises:
        ConfigError: on every rank, when a fresh run is pointed at a used run directory, or run_dir is a file.
    """
    run_dir, error = (None if cfg.run_dir is None else str(Path(cfg.run_dir).expanduser())), ""  # ~ as data.path
    if layout.rank == 0:
        if run_dir is None:  # a name not taken now; Trainer.fit claims it atomically (RunDirLock)
            stamp = str(Path(cfg.runs_root).expanduser() / datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"))
            run_dir, n = stamp, 0
            while Path(run_dir).exists():
                n += 1
                run_dir = f"{stamp}-{n}"
        elif Path(run_dir).exists() and not Path(run_dir).is_dir():
            error = f"trainer.run_dir must be a directory (or not exist yet), not a file: {run_dir}"
        elif not cfg.resume:
            error = _used_by_a_run(Path(run_dir))
    run_dir, error = broadcast_object((run_dir, error), layout)
    if error:
        raise ConfigError(error)
    return Path(run_dir)


class Trainer:
    """One training run. Building it (collective) checks the config, initializes torch.distributed
    and the dp x cp mesh, loads the corpus, picks the run directory, builds model, optimizer,
    scheduler and engine (identical weights on every rank), and with trainer.resume=true loads the
    newest valid checkpoint. Nothing is written before :meth:`fit`.

    Args:
        cfg: a TrainConfig, or a DictConfig of its schema (checked by :func:`to_train_config`).

    Raises:
        ConfigError (a ValueError), on every rank: an unknown key or bad value, parallel.cp does
            not divide the world size, an unreadable data.path, trainer.resume without
            trainer.run_dir or without a valid checkpoint, a config that drifted from the
            checkpoint's, a fresh run in a run directory that holds another run.
    """

    def __init__(self, cfg: TrainConfig | DictConfig) -> None:
        cfg = to_train_config(cfg)
        if cfg.trainer.resume and cfg.trainer.run_dir is None:
            raise ConfigError("trainer.resume=true needs trainer.run_dir (the run to continue)")
        self.cfg = cfg
        self.t_start, self.cpu_start = time.perf_counter(), time.process_time()
        try:
            layout = init_distributed(cfg.parallel, need_group=cfg.deepspeed.enabled)
        except ValueError as exc:  # parallel.cp and the world size, parallel.device=cuda without CUDA
            raise ConfigError(str(exc)) from exc
        if layout.rank != 0:
            logging.getLogger().setLevel(logging.WARNING)
        if cfg.data.batch_size % layout.dp:
            raise ConfigError(f"data.batch_size={cfg.data.batch_size} must be divisible by the data-parallel degree "
                              f"dp = world size {layout.world_size} / parallel.cp {layout.cp} = {layout.dp}")
        self.layout, self.is_main = layout, layout.rank == 0
        try:
            self.corpus = ByteCorpus(cfg.data)
        except (OSError, ValueError) as exc:  # the same files on every rank: the same error everywhere
            raise ConfigError(one_line(exc) if "data." in str(exc) else f"data.path={cfg.data.path!r}: {one_line(exc)}") from exc
        self.run_dir = _resolve_run_dir(cfg.trainer, layout)
        self.entropy = unigram_entropy(self.corpus.data)
        self.data_digest = corpus_digest(self.corpus.data)
        torch.manual_seed(cfg.trainer.seed)
        model = KDALanguageModel(cfg.model).to(layout.device)
        par = cfg.parallel
        parallelize(model, CPContext(layout.cp_group, par.strategy, par.ulysses_impl))
        if layout.distributed:  # identical init everywhere, whatever the RNG did
            for t in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(t.data, src=0)
        self.n_params = model.num_params()
        self.flops_per_token = train_flops_per_token(model, cfg.data.seq_len)
        optimizer = build_optimizer(model, cfg.optim)
        scheduler = build_scheduler(optimizer, cfg.optim, cfg.trainer.max_steps)
        self.engine = build_engine(model, optimizer, scheduler, layout, cfg.deepspeed,
                                   micro_batch=cfg.data.batch_size // layout.dp, grad_clip=cfg.optim.grad_clip)
        barrier = dist.barrier if layout.distributed else (lambda: None)
        self.ckpts = CheckpointManager(self.run_dir, layout.rank, barrier, keep=cfg.trainer.keep_checkpoints,
                                       agree=lambda error: agree(error, layout))
        self.global_tokens = cfg.data.batch_size * cfg.data.seq_len
        self.n_gpus = layout.world_size if layout.device.type == "cuda" else 0
        self.train_time, self.tok_rates, self.mfus = 0.0, [], []
        self.signals, self.stop_requested = StopSignals(), False  # installed by fit()
        self._steps_at_resume: set[int] = set()  # checkpoint steps resume() saw (rank 0)
        self.start_step = self.resume() if cfg.trainer.resume else 0

    def loss_sum(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Sum of this rank's token losses on inputs ``x`` and targets ``y`` ([b, T / cp] bytes), fp32."""
        layout = self.layout
        with _autocast(layout.device, self.cfg.trainer.precision):
            logits = self.engine(x.to(layout.device))
        return F.cross_entropy(logits.flatten(0, 1).float(), y.to(layout.device).flatten(), reduction="sum")

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss (nats/byte) over the fixed validation batches, reduced over all ranks."""
        layout = self.layout
        self.engine.eval()
        total = torch.zeros(2, dtype=torch.float64, device=layout.device)
        for i in range(self.corpus.num_val_batches()):
            x, y = self.corpus.val_batch(i, layout.dp_rank, layout.dp, layout.cp_rank, layout.cp)
            total[0] += self.loss_sum(x, y).double()
            total[1] += y.numel()
        if layout.distributed:
            dist.all_reduce(total)
        self.engine.train()
        return float(total[0] / total[1])

    def step(self, step: int) -> dict:
        """Optimizer step ``step`` (0-based) on its global batch; returns its metrics record.

        Raises:
            FloatingPointError: the loss or the global gradient norm is NaN/Inf (on every rank at
                the same step; the message numbers steps from 1, as metrics.jsonl does).
        """
        layout, engine = self.layout, self.engine
        t0 = time.perf_counter()
        x, y = self.corpus.train_batch(step, layout.dp_rank, layout.dp, layout.cp_rank, layout.cp)
        loss_sum = self.loss_sum(x, y)
        engine.backward(loss_sum / self.global_tokens)
        loss, self.stop_requested = engine.reduce(loss_sum, self.signals.received is not None)
        loss /= self.global_tokens
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {step + 1}: training stops before this step is "
                                     f"applied or saved; {self._saved_note()}")
        lr = engine.lr
        grad_norm = engine.step()
        if grad_norm is not None and not math.isfinite(grad_norm):  # the same on every rank (global norm)
            raise FloatingPointError(f"gradient norm is {grad_norm} at step {step + 1} (loss {loss:.4g}): training "
                                     f"stops before this step is saved; {self._saved_note()}")
        if layout.device.type == "cuda":
            torch.cuda.synchronize(layout.device)
        dt = time.perf_counter() - t0
        self.train_time += dt
        tok_s = self.global_tokens / dt
        entry = {"step": step + 1, "loss": loss, "tokens_per_s": tok_s, "lr": lr, "grad_norm": grad_norm}
        if self.n_gpus:
            entry["mfu"] = tok_s * self.flops_per_token / (self.n_gpus * self.cfg.trainer.peak_tflops * 1e12)
            self.mfus.append(entry["mfu"])
        self.tok_rates.append(tok_s)
        return entry

    def _saved_note(self) -> str:
        """Where a stopped run can go on from: its newest complete checkpoint, or that it has none."""
        steps = self.ckpts.complete_steps()
        if steps:
            return f"the newest checkpoint holds step {steps[0]} (trainer.resume=true continues from it)"
        return (f"no checkpoint was written yet (trainer.checkpoint_every={self.cfg.trainer.checkpoint_every}), so "
                f"there is nothing to resume: start again with a new trainer.run_dir")

    def save_checkpoint(self, step: int) -> None:
        """Collective: the checkpoint of ``step`` (engine state, config, every rank's RNG state), atomic.

        Raises:
            CheckpointWriteError: writing failed on some rank (e.g. a full disk), on every rank.
        """
        cfg, layout = self.cfg, self.layout

        def write(tmp: Path) -> None:
            recorded = saved_config(cfg, layout.device.type)
            self.engine.save(tmp, {"step": step, "config": recorded, "data": self.data_digest})
            if self.is_main:  # read on resume before the weights, to refuse a changed config
                (tmp / "config.json").write_text(json.dumps(recorded, indent=1) + "\n")
            torch.save(_rng_state(layout.device), tmp / f"rng_rank{layout.rank}.pt")

        self.ckpts.save(step, write)

    def resume(self) -> int:
        """Collective: load the newest checkpoint that verifies and loads on every rank; returns its step.

        A checkpoint that fails verification (rank 0: sizes and sha256) or fails to load on any rank
        (missing file, failed unpickle, ...) is skipped with a warning naming the reason, and the one
        before it is tried.

        Raises:
            ConfigError: on every rank: no valid checkpoint (nothing in the run directory is changed),
                a checkpoint past trainer.max_steps or of another world size, or a config that differs
                from the checkpoint's in keys that change the computation.
        """
        cfg, layout, ckpts = self.cfg, self.layout, self.ckpts
        before, skipped = None, []
        if layout.rank == 0:  # what is there now: a step that appears later was written by another run
            self._steps_at_resume = set(ckpts.complete_steps())
        while True:
            found, why = None, ""
            if layout.rank == 0:
                found = ckpts.latest(before)
                skipped += ckpts.skipped
                if found is None and not self.run_dir.is_dir():
                    why = (f"trainer.resume=true: trainer.run_dir={self.run_dir} does not exist: pass the directory "
                           "of the run to continue (the one holding config.yaml and checkpoints/)")
                elif found is not None:
                    saved_ranks = len(list(found.path.glob("rng_rank*.pt")))
                    if found.step > cfg.trainer.max_steps:
                        why = (f"trainer.resume: the newest checkpoint {found.path} is at step {found.step}, past "
                               f"trainer.max_steps={cfg.trainer.max_steps}: raise max_steps to continue it")
                    elif saved_ranks != layout.world_size:
                        why = (f"trainer.resume: {found.path} was written by {saved_ranks} ranks, this run has "
                               f"{layout.world_size}: resume with the same torchrun --nproc_per_node and parallel.cp")
                    elif (found.path / "config.json").is_file():  # checked before loading: a new shape would not load
                        why = drift_message(found.path, json.loads((found.path / "config.json").read_text()), cfg,
                                            layout.device.type)
            found, why, skipped = broadcast_object((found, why, skipped), layout)
            if why:
                raise ConfigError(why)
            if found is None:
                detail = "; ".join(skipped) if skipped else "no checkpoint was written"
                raise ConfigError(f"trainer.resume=true: no valid checkpoint in {ckpts.root} ({detail}); nothing was "
                                  "changed. Restore a checkpoint, or start a fresh run with a new trainer.run_dir")
            error = None
            try:
                client = self.engine.load(found.path)
                rng = torch.load(found.path / f"rng_rank{layout.rank}.pt", weights_only=False)
            except Exception as exc:
                error = f"{found.path.name}: rank {layout.rank}: {type(exc).__name__}: {one_line(exc)}"
            error = agree(error, layout)
            if error is None:
                break
            if layout.rank == 0:
                logger.warning("checkpoint %s could not be loaded (%s): using an earlier one", found.path, error)
            skipped.append(error)
            before = found.step
        why = drift_message(found.path, client.get("config"), cfg, layout.device.type)  # without config.json
        saved_data = client.get("data")  # absent in checkpoints written before it was recorded
        if not why and saved_data is not None and saved_data != self.data_digest:  # agreed below: ranks may differ
            why = (f"trainer.resume: the corpus differs from the one {found.path} was trained on (data.path="
                   f"{cfg.data.path!r}: {saved_data['bytes']} bytes, sha256 {saved_data['sha256'][:12]}... then, "
                   f"{self.data_digest['bytes']} bytes, sha256 {self.data_digest['sha256'][:12]}... now): the same "
                   "steps would read other batches. Restore the corpus, or start a fresh run")
        why = agree(why or None, layout)
        if why:
            raise ConfigError(why)
        _set_rng_state(rng, layout.device)
        if layout.rank == 0:
            logger.info("resumed from %s at step %d", found.path, int(client["step"]))
        return int(client["step"])

    def _claim_run_dir(self) -> bool:
        """Collective, before anything is written: rank 0 makes the run directory (an automatic name
        atomically, moving on to the next free name if another run took it since) and takes its
        :class:`RunDirLock`; then every rank checks that it can write into the checkpoints
        directory. Returns whether this call made the run directory (rank 0).

        Raises:
            ConfigError: on every rank: another live run holds the directory, or it or its
                checkpoints directory cannot be made or written.
        """
        layout, cfg = self.layout, self.cfg
        self._lock = RunDirLock(self.run_dir)
        created, error, run_dir = False, None, self.run_dir
        if self.is_main:
            try:
                run_dir.parent.mkdir(parents=True, exist_ok=True)
                if cfg.trainer.run_dir is None:  # claimed atomically: two runs started together get two names
                    base = str(run_dir)
                    for n in range(1, 1001):
                        try:
                            run_dir.mkdir()
                            break
                        except FileExistsError:
                            run_dir = Path(f"{base}-{n}")
                    else:
                        raise FileExistsError(f"no free run directory name after {base}-999")
                    created = True
                else:
                    try:  # atomic: only the run that made the directory removes it on failure
                        run_dir.mkdir()
                        created = True
                    except FileExistsError:
                        created = False
                self._lock = RunDirLock(run_dir)
                error = self._lock.acquire()
                if error is None and not created:
                    # checked again under the lock: a run that held the directory since __init__'s
                    # check may have written there (two runs given one trainer.run_dir)
                    error = self._advanced_error(run_dir) if cfg.trainer.resume else (_used_by_a_run(run_dir) or None)
                    if error is not None:
                        self._lock.release()
                if error is None:
                    (run_dir / "checkpoints").mkdir(exist_ok=True)
            except OSError as exc:
                error = f"trainer.run_dir={run_dir}: {one_line(exc)}"
            if error is not None and created:
                shutil.rmtree(run_dir, ignore_errors=True)
        error, run_dir = broadcast_object((error, str(run_dir)), layout)
        if error is not None:
            raise ConfigError(error)
        self.run_dir = Path(run_dir)
        self.ckpts.root = self.run_dir / "checkpoints"
        probe = self.ckpts.root / f".probe-rank{layout.rank}"
        try:  # a read-only or full filesystem fails here, not at the first checkpoint after the training
            probe.write_bytes(b"kda_cp")
            probe.unlink()
        except OSError as exc:
            error = (f"trainer.run_dir={run_dir}: rank {layout.rank} cannot write checkpoints into {self.ckpts.root}: "
                     f"{(exc.strerror or one_line(exc)).lower()}")
        error = agree(error, layout)
        if error is not None:
            self._abandon(created)
            raise ConfigError(error)
        return created

    def _advanced_error(self, run_dir: Path) -> str | None:
        """A resumed run: why it must not go on when a checkpoint newer than the one it loaded has
        appeared since it looked (another run wrote it between loading and locking), else None.
        Newer ones that were there already (corrupted, or unloadable) were skipped by the resume."""
        newer = [step for step in self.ckpts.complete_steps()
                 if step > self.start_step and step not in self._steps_at_resume]
        if not newer:
            return None
        return (f"trainer.run_dir={run_dir} advanced to step {max(newer)} while this run loaded step {self.start_step} "
                "(another run wrote it in between): resume again to continue from the newest checkpoint")

    def _abandon(self, created: bool) -> None:
        """A run that stops before its first step: release the lock; remove the run directory
        if this run made it (no empty run directory is left behind)."""
        self._lock.release()
        if created:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def fit(self) -> dict:
        """Collective: train from the start (or resumed) step to trainer.max_steps, evaluating and
        checkpointing on the configured cadence, then at the end; returns the summary dict (also
        written to summary.json on rank 0). A failure before the first step removes the run
        directory this call made. A resumed run already at trainer.max_steps writes nothing and
        returns its summary.json.

        Raises:
            ConfigError: on every rank, before the first step: another live run holds the run
                directory's lock, or the checkpoints directory cannot be written.
            CheckpointWriteError: writing a checkpoint failed (e.g. a full disk), on every rank.
            FloatingPointError: the loss or the gradient norm became NaN/Inf (on every rank at the
                same step, before that step is saved).
            TrainingStopped: SIGTERM or SIGINT arrived (:class:`StopSignals`): the run stopped at
                the next step boundary, on every rank, after saving that step.
        """
        cfg, layout, is_main = self.cfg, self.layout, self.is_main
        start_step, entropy = self.start_step, self.entropy
        finished = start_step >= cfg.trainer.max_steps  # resumed at its last step
        if finished:  # with its summary: change nothing; without (killed before writing it): evaluate, write it
            done = None
            if is_main:
                try:
                    done = json.loads((self.run_dir / "summary.json").read_text())
                    done = done if done.get("steps") == cfg.trainer.max_steps and "val_loss" in done else None
                except (OSError, ValueError, AttributeError):
                    done = None
            done = broadcast_object(done, layout)
            if done is not None:
                if is_main:
                    logger.info("the run in %s is complete at step %d (trainer.max_steps): nothing to do; raise "
                                "trainer.max_steps to train on", self.run_dir, start_step)
                return done
        created = self._claim_run_dir()
        run_dir = self.run_dir
        metrics, error = None, None
        try:  # rank 0 writes; every rank learns of a failure here instead of waiting in the first step
            if is_main:
                (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
            metrics = MetricsLog(run_dir / "metrics.jsonl", is_main, start_step)
        except OSError as exc:
            error = f"trainer.run_dir={run_dir}: rank {layout.rank} cannot write the run's metadata: {one_line(exc)}"
        error = agree(error, layout)
        if error is not None:
            if metrics is not None:
                metrics.close()
            self._abandon(created)
            raise ConfigError(error)
        if is_main:
            logger.info(
                "run dir %s; world %d = dp %d x cp %d on %s; strategy %s; %s",
                run_dir, layout.world_size, layout.dp, layout.cp, layout.device, cfg.parallel.strategy,
                f"DeepSpeed ZeRO-{cfg.deepspeed.stage}" if cfg.deepspeed.enabled else "torch data parallel",
            )
            logger.info(
                "model: %d parameters, %.3g training FLOPs/token; corpus unigram entropy %.4f nats/byte",
                self.n_params, self.flops_per_token, entropy,
            )
        val_loss = float("nan")
        bar = tqdm(
            total=cfg.trainer.max_steps,
            initial=start_step,
            disable=not (is_main and cfg.trainer.progress),
            dynamic_ncols=True,
            desc="train",
        )
        self.engine.train()
        try:
            with self.signals:  # SIGTERM / SIGINT: stop at the next step boundary, its checkpoint saved
                for step in range(start_step, cfg.trainer.max_steps):
                    entry = self.step(step)
                    metrics.record(entry)
                    created = False  # a step is recorded: the run directory stays whatever happens next
                    loss, tok_s, lr = entry["loss"], entry["tokens_per_s"], entry["lr"]
                    bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:.0f}",
                                    **({"mfu": f"{entry['mfu']:.1%}"} if self.n_gpus else {}))
                    bar.update(1)
                    done = step + 1
                    if is_main and (done % cfg.trainer.log_every == 0 or done == 1):
                        logger.info("step %d loss %.4f tokens/s %.0f lr %.2e", done, loss, tok_s, lr)
                    if self.stop_requested and done < cfg.trainer.max_steps:  # agreed in the step's all-reduce
                        self.save_checkpoint(done)
                        raise TrainingStopped(self.signals.received or signal.SIGTERM, done,
                                              self.ckpts.path(done))
                    if cfg.trainer.val_every and done % cfg.trainer.val_every == 0 and done < cfg.trainer.max_steps:
                        val_loss = self.evaluate()
                        metrics.record({"step": done, "val_loss": val_loss})
                        if is_main:
                            logger.info("step %d val_loss %.4f (unigram entropy %.4f)", done, val_loss, entropy)
                    if cfg.trainer.checkpoint_every and done % cfg.trainer.checkpoint_every == 0 \
                            and done < cfg.trainer.max_steps:
                        self.save_checkpoint(done)
                bar.close()
                val_loss = self.evaluate()
                if not finished:  # a finished run has both already
                    metrics.record({"step": cfg.trainer.max_steps, "val_loss": val_loss})
                    self.save_checkpoint(cfg.trainer.max_steps)
        except BaseException:
            metrics.close()
            self._abandon(created)  # created: failed before its first step
            raise
        finally:
            bar.close()
            metrics.close()

        peak = torch.tensor([peak_memory_bytes(layout.device)], dtype=torch.float64, device=layout.device)
        if layout.distributed:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            layout.dims.drain()  # nothing of this run left in flight when the caller tears down
        summary = {
            "val_loss": val_loss,
            "unigram_entropy": entropy,
            "steps": cfg.trainer.max_steps,
            "start_step": start_step,  # > 0 after a resume; tokens, times and rates count this invocation only
            "tokens": self.global_tokens * (cfg.trainer.max_steps - start_step),
            "train_time_s": self.train_time,
            "wall_time_s": time.perf_counter() - self.t_start,
            "cpu_time_s_rank0": time.process_time() - self.cpu_start,
            "median_tokens_per_s": float(np.median(self.tok_rates)) if self.tok_rates else None,
            "median_mfu": float(np.median(self.mfus)) if self.mfus else None,
            "train_flops_per_token": self.flops_per_token,
            "peak_memory_gib": float(peak) / 2**30,
            "peak_memory_kind": "cuda max_memory_allocated" if layout.device.type == "cuda" else "max RSS",
            "world_size": layout.world_size,
            "dp": layout.dp,
            "cp": layout.cp,
            "strategy": cfg.parallel.strategy,
            "zero_stage": cfg.deepspeed.stage,
            "params": self.n_params,
            "run_dir": str(run_dir),
        }
        if is_main:
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            self._lock.release()
            if cfg.trainer.plot:
                plot_losses(run_dir, metrics.history, entropy)
            logger.info(
                "final: validation loss %.4f nats/byte | corpus unigram entropy %.4f nats/byte (steps %d-%d in %.0f s) | "
                "median %.0f tokens/s%s | peak memory %.2f GiB (%s)",
                val_loss, entropy, start_step + 1, cfg.trainer.max_steps, summary["wall_time_s"],
                summary["median_tokens_per_s"] or float("nan"), f", MFU {summary['median_mfu']:.1%}" if self.mfus else "",
                summary["peak_memory_gib"], summary["peak_memory_kind"],
            )
        return summary


def train(cfg: TrainConfig | DictConfig) -> dict:
    """Build a :class:`Trainer` and run it; returns the summary dict (see :meth:`Trainer.fit`).

    Raises:
        ConfigError, CheckpointWriteError, FloatingPointError: as :class:`Trainer` and :meth:`Trainer.fit`.
    """
    return Trainer(cfg).fit()
