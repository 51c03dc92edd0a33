"""Training metrics: metrics.jsonl (one record per step and per evaluation, appended), its
continuation on resume, peak memory for summary.json, and the loss plot (loss.png)."""

from __future__ import annotations

import json
import logging
import os
import resource
from pathlib import Path

import torch

__all__ = ["MetricsLog", "continue_metrics", "peak_memory_bytes", "plot_losses"]

logger = logging.getLogger("kda_cp.train")


class MetricsLog:
    """The run's records: kept in :attr:`history` on every rank, appended to ``path`` (one JSON
    object a line, flushed) on the main rank only. ``start_step`` > 0 continues the file of a
    resumed run (:func:`continue_metrics`)."""

    def __init__(self, path: Path, is_main: bool, start_step: int = 0) -> None:
        self.history: list[dict] = []
        if is_main and start_step:  # the history of the run being continued, up to its checkpoint
            self.history = continue_metrics(path, start_step)
        self._file = open(path, "a") if is_main else None

    def record(self, entry: dict) -> None:
        self.history.append(entry)
        if self._file is not None:
            self._file.write(json.dumps(entry) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def continue_metrics(path: Path, step: int) -> list[dict]:
    """Keep metrics.jsonl's records up to ``step`` and drop the rest, so that the file goes on by
    appending: the records past ``step`` (steps run after the checkpoint) and any unreadable line
    (a last line torn by a crash, or a damaged one; each dropped with a warning, the readable
    records around it kept). The file is rewritten atomically when anything is dropped. Returns
    the kept records."""
    if not path.is_file():
        return []
    data = path.read_bytes()
    lines = data.splitlines(keepends=True)
    kept, out, pos = [], [], 0
    for n, raw in enumerate(lines):
        if raw.strip():
            try:
                rec = json.loads(raw)
                rec_step = int(rec["step"])
            except (ValueError, KeyError, TypeError, OverflowError):  # OverflowError: "step": Infinity
                torn = not any(x.strip() for x in lines[n + 1 :])
                logger.warning("%s: dropping an unreadable line at byte %d (%s): %r", path, pos,
                               "torn by a crash" if torn else "damaged", raw[:80])
                pos += len(raw)
                continue
            if rec_step > step:
                break
            kept.append(rec)
            out.append(raw if raw.endswith(b"\n") else raw + b"\n")  # a last record that lost its newline
        pos += len(raw)
    new = b"".join(out)
    if new != data:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as fh:
            fh.write(new)
            fh.flush()
            os.fsync(fh.fileno())  # on disk before it replaces the old file
        os.replace(tmp, path)
    return kept


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA allocator peak on GPU; the process's max resident set size on CPU (ru_maxrss, KiB on Linux)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def plot_losses(run_dir: Path, history: list[dict], entropy: float) -> Path | None:
    """loss.png in ``run_dir``: train and validation loss against the unigram entropy; None without matplotlib."""
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
