#!/usr/bin/env bash
# Set up and run kda_cp on a fresh machine: Python >= 3.10 (with its venv module) and a C++ compiler.
#
#   bash scripts/run.sh train [hydra overrides...]   the main job: torchrun --nproc_per_node=2 scripts/train.py
#                                                     parallel.device=cpu (unless parallel.device is given)
#   bash scripts/run.sh test  [pytest args...]       the tests: python -m pytest -q
#
# Both first make the virtual environment $KDA_VENV (default .venv) if it is missing, and install
# into it: without a GPU the pinned CPU build torch==2.13.0 (an unpinned torch would pull a
# multi-GB CUDA build; set TORCH_INDEX_URL, e.g. https://download.pytorch.org/whl/cpu, where the
# default index serves only CUDA builds), then the project with its extras, pip install -e
# ".[dev,gpu]". The install is skipped when pyproject.toml has not changed since the last one.
# $PYTHON picks the interpreter that makes the venv (default: the newest python3.1x >= 3.10).
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { echo "usage: bash scripts/run.sh {train|test} [args...]" >&2; exit 2; }
[ $# -ge 1 ] || usage
verb=$1
shift
case "$verb" in train|test) ;; *) usage ;; esac

VENV=${KDA_VENV:-.venv}
TORCH_PIN=torch==2.13.0

find_python() {
  local c
  for c in ${PYTHON:-} python3.13 python3.12 python3.11 python3.10 python3; do
    if command -v "$c" >/dev/null 2>&1 &&
       "$c" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
      echo "$c"
      return 0
    fi
  done
  echo "run.sh: needs Python >= 3.10 (set PYTHON=/path/to/python3)" >&2
  return 1
}

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    local py
    py=$(find_python)
    echo "run.sh: creating $VENV with $py" >&2
    "$py" -m venv "$VENV" || {
      echo "run.sh: '$py -m venv' failed; install the venv module (e.g. apt-get install python3-venv)" >&2
      return 1
    }
  fi
  local stamp="$VENV/.kda_cp-installed" want
  want="$(cat pyproject.toml; has_gpu && echo gpu || echo "cpu $TORCH_PIN")"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  local pip=("$VENV/bin/python" -m pip install -q)
  "${pip[@]}" --upgrade pip
  if ! has_gpu; then
    "${pip[@]}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_PIN"
  fi
  "${pip[@]}" -e ".[dev,gpu]"
  printf '%s' "$want" > "$stamp"
}

setup
export PATH="$PWD/$VENV/bin:$PATH"
case "$verb" in
  train)  # the main job runs on the CPU, also where there are GPUs, unless parallel.device is given
    device=(parallel.device=cpu)
    for a in "$@"; do case "$a" in parallel.device=*) device=() ;; esac; done
    exec "$VENV/bin/python" -m torch.distributed.run --nproc_per_node=2 scripts/train.py "${device[@]}" "$@" ;;
  test) exec "$VENV/bin/python" -m pytest -q "$@" ;;
esac
