"""Build and maintenance tools of sglang-train-parity: the pinned upstream, the patch series, the wheel."""
