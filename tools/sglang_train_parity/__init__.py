# SPDX-License-Identifier: Apache-2.0
"""Tools that check ``--numerics train_parity``: the training-side reference (diffusers + PEFT
under CUDA's autocast policy, emulated on CPU), the sglang DiT driven the same way, per-module
comparison, a tiny Qwen-Image model built locally, the parity check and the rollout demo."""
