"""What the engine sees of speculative decoding: the SpecRuntime protocol, loaded by name.

The engine never imports `deltaserve.spec`; `load_spec_runtime` imports `deltaserve.spec.runner`
only when `--speculative-algorithm` is set.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from deltaserve.config import EngineConfig
    from deltaserve.core import Batch, Req
    from deltaserve.engine.cuda_graph import VerifyChain


class SpecRuntime(Protocol):
    """The target side of a verify step, as the engine drives it."""

    num_steps: int  # k: drafts per request per verify step
    wants_hidden: bool  # the proposer reads the target's final hidden states
    chains_verify: bool  # propose_chained can draft (engine/overlap_verify.py)

    def propose(self, batch: Batch) -> None:
        """Fill `batch.draft_ids` (k per request, padded) or `batch.draft_tensor` (int64
        [N, k] on the device), and `batch.num_drafts`."""

    def use_graphs(self, max_reqs: int, max_kv_len: int, capture: bool = True) -> None:
        """The engine's decode/verify steps run as CUDA graphs (see Proposer.use_graphs)."""

    def propose_chained(self, batch: Batch, chain: VerifyChain,
                        hidden: torch.Tensor | None) -> bool:
        """Drafts on the device for a verify batch launched before the previous verify step of
        the same requests landed (`chain`: its starts and device acceptance; `hidden`: its
        target hidden states); False when they cannot be made so."""

    def on_chained_commit(self, batch: Batch, committed: list[int]) -> None:
        """After a verify step whose committed rows `propose_chained` already consumed."""

    def accept(self, batch: Batch, logits: torch.Tensor, greedy: torch.Tensor | None = None,
               accepted: torch.Tensor | None = None) -> dict[int, list[int]]:
        """Tokens to commit per request id from the verify logits [N * (k+1), V] (fp32);
        greedy [N * (k+1)] int64 (device), when given, is logits.argmax(-1) already computed;
        accepted [N, k+2] int64 (device), when given with greedy, the verify graph's greedy
        acceptance (ForwardOutput.accepted)."""

    def on_forward(self, batch: Batch, hidden: torch.Tensor | None) -> None:
        """After the target's forward of any batch (prefill, decode or verify)."""

    def on_commit(self, batch: Batch, committed: list[int]) -> None:
        """After a verify step: committed[i] rows of request i were kept."""

    def release(self, req: Req) -> None:
        """A request finished or was aborted."""


def load_spec_runtime(cfg: EngineConfig, model, runner) -> SpecRuntime | None:
    """The SpecRunner for `cfg.speculative_algorithm`, or None when speculation is off.

    Raises ValueError for a combination that is not supported (named in the message).
    """
    if cfg.speculative_algorithm is None:
        return None
    module = importlib.import_module("deltaserve.spec.runner")
    return module.SpecRunner.build(cfg, model, runner)
