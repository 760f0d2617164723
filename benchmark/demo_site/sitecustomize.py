"""Put this folder first on PYTHONPATH of the GPU demo and of its servers
(`sglang-train-parity demo --device cuda --server-site benchmark/demo_site`, what
`bash benchmark/run_h200.sh demo` runs): every Python process there then installs
benchmark/server_harness.py (sgl_kernel stand-ins that fail loudly, and the logged native
fallbacks of the components outside the parity contract). The repository root is appended to
sys.path, after every installed package, so that `benchmark` imports."""

import sys
from pathlib import Path

_REPO = str(Path(__file__).resolve().parents[2])
if _REPO not in sys.path:
    sys.path.append(_REPO)

from benchmark import server_harness  # noqa: E402

server_harness.install()
