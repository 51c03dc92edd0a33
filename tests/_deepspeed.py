"""DeepSpeed in tests: whether it is installed, and its CPU comm op built once before ranks start.

DeepSpeed's CPU accelerator JIT-builds ``deepspeed_shm_comm`` (into ~/.cache/torch_extensions) the
first time a process initializes deepspeed.comm. Building it here, in the pytest process, keeps
several freshly spawned ranks from compiling it at the same time. torch guards that build with a
``lock`` file and waits for it to vanish with no deadline, so a build killed midway (a run
interrupted, a rank SIGKILLed) would hang every later test: a lock older than any build is removed.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import time
import warnings

import pytest

INSTALL = "deepspeed is not installed (pip install deepspeed==0.19.8)"


def has_deepspeed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


@functools.lru_cache(maxsize=None)
def prebuild_ops() -> None:
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:
        return
    _remove_stale_lock(builder.name)
    builder.load()


STALE_LOCK_S = 900  # the op builds in under 2 minutes on 2 cores


def _remove_stale_lock(name: str) -> None:
    from torch.utils.cpp_extension import _get_build_directory

    lock = os.path.join(_get_build_directory(name, verbose=False), "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:
        return
    if age > STALE_LOCK_S:
        warnings.warn(f"removing {lock}, left {age:.0f} s ago by a build that did not finish")
        os.remove(lock)


def require_deepspeed() -> None:
    """Fail (not skip) without deepspeed; build its CPU comm op once."""
    if not has_deepspeed():
        pytest.fail(INSTALL)
    prebuild_ops()
