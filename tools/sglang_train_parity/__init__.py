# SPDX-License-Identifier: Apache-2.0
"""The fork's tools for ``--numerics train_parity`` (not part of sglang, never imported by its
server): the training-side reference (diffusers + PEFT under CUDA's autocast policy, emulated on
CPU), the sglang DiT driven the same way, per-module comparison, the families the tools know and
a tiny model of each, the trainer's side of the policy checksum, the parity check and the rollout
demo (``sglang-train-parity check|demo``)."""
