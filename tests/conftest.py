"""Skip tests marked ``gpu`` when no CUDA device is present; keep torch's C++ extension builds
(DeepSpeed's CPU comm op) inside this checkout."""

import os
from pathlib import Path

import pytest
import torch

# Each checkout builds DeepSpeed's op in its own directory (inherited by every rank the tests
# start), so a build killed in another checkout or venv cannot leave a lock that this run waits on.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker 'gpu')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
