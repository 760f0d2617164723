#!/usr/bin/env bash
# A CPU virtual environment (default .venv) with torch, diffusers, PEFT and the subset of sglang's
# dependencies that sglang.multimodal_gen needs on a CPU machine, ltx-core (LTX-2's trainer model,
# requirements/cpu-no-deps.txt), plus the fork built from this
# checkout. Prints the environment's folder. Used by run-tests.sh and run-demo.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-.venv}
python=${PYTHON:-python3.11}
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install -r requirements/cpu.txt >&2
"${pip[@]}" install --no-deps -r requirements/cpu-no-deps.txt >&2
"${pip[@]}" install --no-deps --force-reinstall . >&2
echo "$venv"
