"""Atomic, verifiable checkpoint directories: written aside, sealed with a manifest, renamed into place.

Layout under a run directory::

    checkpoints/step_00000040/      a complete checkpoint (whatever the writer put there:
        ...                         torch.save files, or DeepSpeed's per-rank shards)
        MANIFEST.json               written LAST: step, and every file's relative path and size
    checkpoints/.tmp-step_00000050/ a checkpoint being written (ignored when reading)

Saving (collective over all ranks): rank 0 makes an empty ``.tmp-step_N``; every rank writes its
files into it (``write(tmp_dir)``); after a barrier, rank 0 lists the files with their sizes into
``MANIFEST.json`` (itself written to a temporary name and os.replace'd), fsyncs, and renames the
directory to ``step_N`` with os.replace (atomic on one filesystem); older checkpoints beyond
``keep`` are deleted, never the one just written. A process killed at any point leaves either the
previous complete checkpoint or the new one, never a half-written ``step_N`` that passes
verification. Saving a step that already has a checkpoint (a run resumed before it) first renames
the old copy to ``.old-step_N``, which :meth:`CheckpointManager.latest` still reads should the
process die before the new copy is in place, and deletes it after.

Reading: :meth:`CheckpointManager.latest` walks the ``step_*`` directories from the newest and
returns the first whose manifest exists, parses, names the step, and matches every listed file's
size; a directory that fails (cut off mid-write, truncated file, missing manifest) is logged and
skipped, so the previous checkpoint is used.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

__all__ = ["CheckpointManager", "CheckpointInfo", "MANIFEST", "verify"]

logger = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
_PREFIX = "step_"
_TMP_PREFIX = ".tmp-"
_OLD_PREFIX = ".old-"


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _listing(root: Path) -> dict[str, int]:
    return {
        str(p.relative_to(root)): p.stat().st_size
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


def verify(path: Path) -> tuple[int | None, str]:
    """(step, "") when ``path`` holds a complete checkpoint, else (None, the reason)."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return None, f"no {MANIFEST} (cut off before it was sealed)"
    try:
        meta = json.loads(manifest.read_text())
        step, files = int(meta["step"]), dict(meta["files"])
    except (ValueError, KeyError, TypeError, OverflowError) as exc:
        return None, f"unreadable {MANIFEST}: {exc}"
    for rel, size in files.items():
        f = path / rel
        if not f.is_file():
            return None, f"missing file {rel}"
        if f.stat().st_size != size:
            return None, f"file {rel} has {f.stat().st_size} bytes, the manifest says {size}"
    return step, ""


class CheckpointManager:
    """Writes and finds the checkpoints of one run (see the module docstring).

    Args:
        run_dir: the run directory (shared by all ranks).
        rank: this process's global rank (rank 0 creates, seals, renames and prunes).
        barrier: a callable that blocks until every rank reached it (``lambda: None`` for one process).
        keep: number of complete checkpoints kept (>= 1; 2 keeps a fallback).

    Raises:
        ValueError: keep is not an int >= 1.
    """

    def __init__(self, run_dir: str | Path, rank: int, barrier: Callable[[], None], keep: int = 2) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"trainer.keep_checkpoints must be an int >= 1, got {keep!r}")
        self.root = Path(run_dir) / "checkpoints"
        self.rank = rank
        self.barrier = barrier
        self.keep = keep

    def path(self, step: int) -> Path:
        return self.root / f"{_PREFIX}{step:08d}"

    def save(self, step: int, write: Callable[[Path], None]) -> Path:
        """Collective: every rank calls ``write(tmp_dir)`` to put its files in; returns the final dir.

        Raises:
            ValueError: step is not an int >= 0 (checked before anything is written).
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"checkpoint step must be an int >= 0, got {step!r}")
        final = self.path(step)
        tmp = self.root / f"{_TMP_PREFIX}{final.name}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        self.barrier()
        write(tmp)
        self.barrier()
        if self.rank == 0:
            for f in tmp.rglob("*"):
                if f.is_file():
                    with open(f, "rb+") as fh:
                        os.fsync(fh.fileno())
            sealed = tmp / (MANIFEST + ".tmp")
            sealed.write_text(json.dumps({"step": step, "files": _listing(tmp)}, indent=1))
            os.replace(sealed, tmp / MANIFEST)
            _fsync_dir(tmp)
            old = self.root / f"{_OLD_PREFIX}{final.name}"
            if final.exists():  # a re-run of the same step: the old copy is set aside, not deleted yet
                if old.exists():
                    shutil.rmtree(old)
                os.replace(final, old)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            if old.exists():
                shutil.rmtree(old)
            self._prune(step)
            logger.info("checkpoint step %d -> %s", step, final)
        self.barrier()
        return final

    def _prune(self, written: int) -> None:
        """Keep the checkpoint just written and the ``keep - 1`` newest complete ones before it."""
        older = [c for c in self._candidates() if c.step < written and verify(c.path)[0] is not None]
        for c in older[self.keep - 1 :]:
            shutil.rmtree(c.path, ignore_errors=True)

    def _candidates(self) -> list[CheckpointInfo]:
        """``step_N`` directories, newest first; a ``.old-step_N`` (set aside by a re-save of step N
        that did not finish) stands in for a missing ``step_N``."""
        if not self.root.is_dir():
            return []
        found: dict[int, Path] = {}
        for prefix in (_OLD_PREFIX + _PREFIX, _PREFIX):  # step_N wins over .old-step_N
            for p in self.root.iterdir():
                if p.is_dir() and p.name.startswith(prefix) and p.name[len(prefix) :].isdigit():
                    found[int(p.name[len(prefix) :])] = p
        return [CheckpointInfo(s, found[s]) for s in sorted(found, reverse=True)]

    def latest(self) -> CheckpointInfo | None:
        """The newest complete checkpoint, or None; incomplete ones are logged and skipped."""
        for c in self._candidates():
            step, why = verify(c.path)
            if step is not None and step == c.step:
                return c
            logger.warning("checkpoint %s is incomplete (%s): using an earlier one", c.path, why or "step mismatch")
        return None
