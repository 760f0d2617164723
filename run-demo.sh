#!/usr/bin/env bash
# The main job: the CPU environment (scripts/setup-env.sh), then `sglang-train-parity demo` on the
# embedded tiny Qwen-Image model; extra arguments go to the demo (see --help).
set -euo pipefail
cd "$(dirname "$0")"
venv=$(bash scripts/setup-env.sh)
exec "$venv/bin/sglang-train-parity" demo "$@"
