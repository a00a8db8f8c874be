"""The Proposer base: makes up to k drafts per request; every hook defaults to a no-op."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from deltaserve.core import Batch, Req
    from deltaserve.engine.cuda_graph import VerifyChain


class Proposer:
    """A draft method. Subclasses implement `propose`; the hooks let a method watch the
    target's forwards (feature sink), its prefill, each verify's outcome, and finished requests.

    `num_steps` is k, the most drafts `propose` may return per request.
    """

    num_steps: int = 0
    wants_hidden: bool = False  # set: the target hands its final hidden states to the hooks
    chains_verify: bool = False  # set: `propose_chained` can draft (engine/overlap_verify.py)
    # with wants_hidden: for how many more decode steps a step's `hidden` may be read (kept
    # rows are copied before that), so a graph may hand out a view of a ring that long
    hidden_steps_held: int = 0

    def propose(self, reqs: list[Req]) -> list[list[int]] | torch.Tensor:
        """Up to `num_steps` draft tokens per request, continuing `req.all_ids`; or an int64
        device tensor [len(reqs), num_steps] (all k drafts for every request, left on the
        device, valid until the next `propose`). Mutates nothing the scheduler owns."""
        raise NotImplementedError

    def use_graphs(self, max_reqs: int, max_kv_len: int, capture: bool = True) -> None:
        """The engine runs its decode/verify steps as CUDA graphs for up to `max_reqs`
        requests of up to `max_kv_len` positions: a proposer may build its own (capture=False:
        the same fixed-shape steps, run eagerly)."""

    def on_forward(self, batch: Batch, hidden: torch.Tensor | None) -> None:
        """After any target forward (the feature sink); `hidden` [T, hidden] (after the final
        norm) when `wants_hidden`, else None; a decode step's may be a view that the
        `hidden_steps_held`-th decode step after it overwrites. Nothing is committed yet."""

    def on_commit(self, batch: Batch, committed: list[int]) -> None:
        """After a verify step: committed[i] of request i's k+1 rows were kept (1..k+1)."""

    def propose_chained(self, reqs: list[Req], chain: VerifyChain,
                        hidden: torch.Tensor | None) -> torch.Tensor | None:
        """Drafts int64 [len(reqs), num_steps] on the device for a verify step launched before
        the previous verify step of `reqs` (same order) landed: its committed rows are known
        only on the device (`chain`, engine/cuda_graph.VerifyChain; `hidden` its target hidden
        states when `wants_hidden`). None: this proposer cannot (the default), and the engine
        lands that step first."""
        return None

    def on_chained_commit(self, batch: Batch, committed: list[int]) -> None:
        """`on_commit` for a verify step whose committed rows the next step's
        `propose_chained` has already consumed."""

    def release(self, req: Req) -> None:
        """`req` finished or was aborted: drop whatever was kept for it."""
