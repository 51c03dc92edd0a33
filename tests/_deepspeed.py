"""DeepSpeed in tests: whether it is installed, and its CPU comm op built once before ranks start.

DeepSpeed's CPU accelerator JIT-builds ``deepspeed_shm_comm`` (into ~/.cache/torch_extensions) the
first time a process initializes deepspeed.comm. Building it here, in the pytest process, keeps
several freshly spawned ranks from compiling it at the same time.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest

INSTALL = "deepspeed is not installed (pip install deepspeed==0.19.8)"


def has_deepspeed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


@functools.lru_cache(maxsize=None)
def prebuild_ops() -> None:
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        builder.load()


def require_deepspeed() -> None:
    """Fail (not skip) without deepspeed; build its CPU comm op once."""
    if not has_deepspeed():
        pytest.fail(INSTALL)
    prebuild_ops()
