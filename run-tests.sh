#!/usr/bin/env bash
# The project's test command: a CPU virtual environment in .venv with torch, diffusers, PEFT and the
# subset of sglang's dependencies that importing sglang.multimodal_gen needs on a CPU machine; the
# fork built from this checkout and installed into it; then pytest (extra arguments go to pytest).
set -euo pipefail
cd "$(dirname "$0")"
venv=${VENV:-.venv}
python=${PYTHON:-python3.11}
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install -r requirements/cpu.txt
"${pip[@]}" install --no-deps --force-reinstall .
exec "$venv/bin/python" -m pytest "$@"
