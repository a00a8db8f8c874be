"""Kernels for the GDN layers: one Python function per op.

Each op runs the `deltaserve._C` extension for CUDA tensors when it is built and the pure-torch
reference beside it otherwise (CPU, or a CUDA machine without the extension). Shapes and the
math are in docs/interfaces.md ("ops/").
"""

from deltaserve.ops.conv1d import (
    causal_conv1d_commit,
    causal_conv1d_prefill,
    causal_conv1d_update,
    causal_conv1d_verify,
)
from deltaserve.ops.gdn import (
    GDNStash,
    gdn_decode,
    gdn_gates,
    gdn_prefill,
    gdn_replay,
    gdn_verify,
)
from deltaserve.ops.snapshot import snapshot_copy

__all__ = [
    "GDNStash",
    "causal_conv1d_commit",
    "causal_conv1d_prefill",
    "causal_conv1d_update",
    "causal_conv1d_verify",
    "gdn_decode",
    "gdn_gates",
    "gdn_prefill",
    "gdn_replay",
    "gdn_verify",
    "snapshot_copy",
]
