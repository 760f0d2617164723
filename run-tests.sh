#!/usr/bin/env bash
# The project's test command: the CPU environment (scripts/setup-env.sh), then pytest; extra
# arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
venv=$(bash scripts/setup-env.sh)
exec "$venv/bin/python" -m pytest "$@"
