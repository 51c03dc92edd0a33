"""Byte-level text data: the embedded default corpus, a held-out split, deterministic sharded batches.

Default corpus: the Python standard library's own source files, which every machine with Python has
(``sysconfig.get_paths()["stdlib"]``, ``*.py``, sorted paths, site-packages and test/idlelib dirs
excluded, capped at ``max_bytes``), concatenated as raw bytes: vocabulary 256. Any text file, or a
folder (files matching ``pattern``, sorted), replaces it via ``data.path``.

Split: the last ``val_fraction`` of the byte stream is the validation split, the rest is training.

Sampling: batch ``step`` of the training stream is a pure function of (seed, step): ``batch_size``
windows of ``seq_len + 1`` bytes at offsets drawn by ``numpy.random.default_rng([seed, step])``. So
runs are reproducible and resumable, and the world layout does not change the data: data-parallel
rank d takes rows [d * B / dp, (d + 1) * B / dp) of the global batch, and CP rank r of a row reads
only tokens [r * T / P, (r + 1) * T / P) of the inputs and the same slice of the targets
(targets = inputs shifted by one; the slice reads seq_len/P + 1 bytes).
"""

from __future__ import annotations

import logging
import math
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kda_cp.parallel.sharding import shard_bounds

__all__ = [
    "DataConfig",
    "ByteCorpus",
    "load_corpus",
    "stdlib_files",
    "unigram_entropy",
]

logger = logging.getLogger(__name__)

_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


@dataclass
class DataConfig:
    """Where the bytes come from, how they are split, and how batches are drawn."""

    path: str | None = None
    """A text file or folder to train on; None means the Python standard library's sources."""
    pattern: str = "*.py"
    """Glob of the files taken (recursively, sorted) when ``path`` is a folder or the stdlib."""
    max_bytes: int = 32_000_000
    """Cap on the corpus size in bytes (files are taken in sorted order until the cap)."""
    val_fraction: float = 0.02
    """Fraction of the byte stream, at its end, held out for validation."""
    seq_len: int = 512
    """Tokens per sequence T (the global length, before CP sharding)."""
    batch_size: int = 16
    """Global batch size in sequences (split over data-parallel ranks)."""
    seed: int = 0
    """Seed of the batch sampler: batch ``step`` depends only on (seed, step)."""
    val_batches: int = 8
    """Validation batches (of ``batch_size`` sequences) per evaluation; consecutive windows from the start of the split."""

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "max_bytes", "val_batches", "seed"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, int):
                raise ValueError(f"data.{name} must be an int, got {x!r}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        for name in ("seq_len", "batch_size", "max_bytes", "val_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.{name} must be >= 1, got {getattr(self, name)}")
        if self.seed < 0:  # numpy's generators take non-negative seeds only
            raise ValueError(f"data.seed must be >= 0, got {self.seed}")


def stdlib_files(pattern: str = "*.py") -> list[Path]:
    """The standard library's source files matching ``pattern``, sorted, without tests and site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        p for p in root.rglob(pattern) if p.is_file() and not _EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1])
    )


def _files(path: str | None, pattern: str) -> list[Path]:
    if path is None:
        files = stdlib_files(pattern)
        if not files:
            raise ValueError(f"data.pattern={pattern!r}: no file of the standard library "
                             f"({sysconfig.get_paths()['stdlib']}) matches it")
        return files
    p = Path(path).expanduser()
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob(pattern) if f.is_file())
        if not files:
            raise ValueError(f"data.path={path!r}: no files match pattern {pattern!r}")
        return files
    raise ValueError(f"data.path={path!r} is neither a file nor a folder")


def load_corpus(path: str | None = None, pattern: str = "*.py", max_bytes: int = 32_000_000) -> np.ndarray:
    """Read the corpus as one uint8 array (files concatenated in sorted order, capped at max_bytes).

    Raises:
        ValueError: ``path`` missing, no matching files, or an empty corpus.
    """
    chunks, total = [], 0
    for f in _files(path, pattern):
        if total >= max_bytes:
            break
        b = f.read_bytes()[: max_bytes - total]
        chunks.append(b)
        total += len(b)
    data = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    if data.size == 0:
        raise ValueError(f"data.path={path!r}: the corpus is empty")
    return data


def unigram_entropy(data: np.ndarray | torch.Tensor) -> float:
    """Entropy of the byte distribution of ``data`` in nats per byte: -sum_b p_b log p_b.

    It is the loss of the best model that ignores context; a language model must go below it.
    """
    counts = np.bincount(np.asarray(data, dtype=np.uint8).ravel(), minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


class ByteCorpus:
    """A byte corpus with its train/validation split and a deterministic, sharded batch sampler.

    Args:
        config: a :class:`DataConfig`.
        data: optional uint8 array to use instead of reading ``config.path`` (tests).

    Raises:
        ValueError: a split too short for one window of ``seq_len + 1`` bytes.
    """

    def __init__(self, config: DataConfig, data: np.ndarray | None = None) -> None:
        self.config = config
        self.data = load_corpus(config.path, config.pattern, config.max_bytes) if data is None else data
        n_val = max(int(math.floor(self.data.size * config.val_fraction)), 0)
        self.n_train = self.data.size - n_val
        self.train = self.data[: self.n_train]
        self.val = self.data[self.n_train :]
        need = config.seq_len + 1
        if self.train.size < need or self.val.size < need:
            raise ValueError(
                f"data: splits of {self.train.size} (train) and {self.val.size} (val) bytes are too short for "
                f"seq_len + 1 = {need}; lower data.seq_len or raise data.val_fraction"
            )
        logger.info(
            "corpus: %d bytes (%s), train %d, val %d",
            self.data.size,
            config.path or "python stdlib",
            self.train.size,
            self.val.size,
        )

    def _rows(self, dp_rank: int, dp_size: int) -> range:
        B = self.config.batch_size
        if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
            raise ValueError(f"dp_size (the data-parallel degree) must be an int >= 1, got {dp_size!r}")
        if B % dp_size:
            raise ValueError(f"data.batch_size={B} must be divisible by the data-parallel degree {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
        n = B // dp_size
        return range(dp_rank * n, (dp_rank + 1) * n)

    def _windows(self, split: np.ndarray, offsets: np.ndarray, rows: range, cp_rank: int, cp_size: int):
        T = self.config.seq_len
        if not 0 <= cp_rank < cp_size:
            raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
        a, b = shard_bounds(T, cp_size)[cp_rank]
        # Read only this shard: inputs [a, b) and targets [a + 1, b + 1) of each window.
        buf = np.stack([split[offsets[i] + a : offsets[i] + b + 1] for i in rows])
        x = torch.from_numpy(buf[:, :-1].astype(np.int64))
        y = torch.from_numpy(buf[:, 1:].astype(np.int64))
        return x, y

    def train_offsets(self, step: int) -> np.ndarray:
        """Start offsets of the ``batch_size`` windows of training batch ``step`` (global batch)."""
        rng = np.random.default_rng([self.config.seed, step])
        return rng.integers(0, self.train.size - self.config.seq_len, size=self.config.batch_size)

    def train_batch(self, step: int, dp_rank: int = 0, dp_size: int = 1, cp_rank: int = 0, cp_size: int = 1):
        """This rank's part of training batch ``step``.

        Returns:
            (inputs, targets): int64 [batch_size / dp_size, T_r] each, T_r = this CP rank's shard
            length; targets are the next bytes of the inputs.
        """
        return self._windows(self.train, self.train_offsets(step), self._rows(dp_rank, dp_size), cp_rank, cp_size)

    def num_val_batches(self) -> int:
        """Validation batches available (at most ``val_batches``; at least 1)."""
        per_batch = self.config.batch_size * self.config.seq_len
        return max(1, min(self.config.val_batches, (self.val.size - 1) // per_batch))

    def val_batch(self, index: int, dp_rank: int = 0, dp_size: int = 1, cp_rank: int = 0, cp_size: int = 1):
        """Validation batch ``index``: consecutive windows (wrapping within the split), fixed across runs."""
        T, B = self.config.seq_len, self.config.batch_size
        n_windows = (self.val.size - 1) // T
        offsets = ((index * B + np.arange(B)) % n_windows) * T
        return self._windows(self.val, offsets, self._rows(dp_rank, dp_size), cp_rank, cp_size)


def default_corpus_size() -> int:
    """Bytes of the default (stdlib) corpus before the cap; for reporting."""
    return sum(os.path.getsize(p) for p in stdlib_files())
