# SPDX-License-Identifier: Apache-2.0
"""The Wan DiT module imports on CUDA without nvidia-cutlass-dsl: its CuTe-DSL
q/k norm-RoPE kernels load on first use."""

import subprocess
import sys

# Import the module's dependencies on this platform first, then the module
# itself again as on CUDA, with cutlass unavailable.
_PROBE = """
import importlib
import sys
from unittest.mock import patch

from sglang.multimodal_gen.runtime.models.dits import wanvideo
from sglang.multimodal_gen.runtime.platforms import current_platform

del sys.modules[wanvideo.__name__]
sys.modules["cutlass"] = None  # any import of it raises ImportError
with patch.object(current_platform, "is_cuda", return_value=True):
    wanvideo = importlib.import_module(wanvideo.__name__)
assert wanvideo._is_cuda
assert "sglang.kernels.ops.diffusion.rope.rmsnorm_interleaved_rope_cutedsl" not in (
    sys.modules
)
"""


def test_wan_dit_module_imports_without_the_cutedsl_kernels():
    result = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
