"""Run kda_cp.train.train() for several configs inside ONE torchrun world (tests/train/test_train_scale.py).

    torchrun --standalone --nproc_per_node=4 tests/_train_layouts.py '<json: list of override lists>'

Every rank composes each config with Hydra and calls train(); the process group is made once (by
the first train() call) and reused, so one launch covers several dp x cp layouts.
"""

from __future__ import annotations

import faulthandler
import json
import sys
from pathlib import Path

import torch.distributed as dist
from hydra import compose, initialize_config_dir

from kda_cp.train import train
from kda_cp.train.cli import exit_process

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    faulthandler.enable()  # an abort prints every thread's Python stack into the test's message
    cases = json.loads(sys.argv[1])
    try:
        for i, overrides in enumerate(cases):
            with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
                cfg = compose(config_name="config", overrides=overrides)
            train(cfg)  # ends with a barrier on each of its groups (ParallelDims.drain)
            print(f"rank {dist.get_rank()}: case {i} done", flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_process(main(), distributed=True)
