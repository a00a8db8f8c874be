"""SpecRunner: the engine's SpecRuntime. Asks the proposer for drafts, pads them to k, and
turns verify logits into committed tokens with exact rejection sampling."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deltaserve.engine.sampling import SamplingRow, sample_rows
from deltaserve.spec.proposer import Proposer
from deltaserve.spec.rejection import accept, verify_rows

if TYPE_CHECKING:
    import torch

    from deltaserve.config import EngineConfig
    from deltaserve.core import Batch, Req


class SpecRunner:
    """Drives one Proposer for verify steps of k+1 rows per request."""

    def __init__(self, proposer: Proposer, num_steps: int) -> None:
        self.proposer = proposer
        self.num_steps = num_steps

    @property
    def wants_hidden(self) -> bool:
        return self.proposer.wants_hidden

    @classmethod
    def build(cls, cfg: EngineConfig, model, runner) -> SpecRunner:
        k = cfg.speculative_num_steps
        if k < 1:
            raise ValueError("--speculative-num-steps must be >= 1 with --speculative-algorithm")
        if cfg.decode_rows_per_req != k + 1:
            raise ValueError("decode_rows_per_req must be speculative_num_steps + 1")
        if cfg.speculative_algorithm == "ngram":
            from deltaserve.spec.ngram.proposer import NgramProposer

            return cls(NgramProposer(k), k)
        if cfg.speculative_algorithm == "mtp":
            if getattr(model, "mtp", None) is None:
                raise ValueError("--speculative-algorithm mtp needs a checkpoint with mtp.* "
                                 "weights; this one has none")
            from deltaserve.spec.mtp.proposer import MTPProposer

            return cls(MTPProposer(model, runner, k, cfg), k)
        raise ValueError(f"unknown speculative algorithm {cfg.speculative_algorithm!r}; "
                         "supported: mtp, ngram")

    def propose(self, batch: Batch) -> None:
        k = self.num_steps
        drafts = self.proposer.propose(batch.reqs)
        batch.draft_ids, batch.num_drafts = [], []
        for req, d in zip(batch.reqs, drafts):
            d = list(d[:k])
            batch.num_drafts.append(len(d))
            pad = d[-1] if d else req.tokens(req.num_tokens - 1, req.num_tokens)[0]
            batch.draft_ids.append(d + [pad] * (k - len(d)))

    def accept(self, batch: Batch, logits: torch.Tensor,
               greedy: torch.Tensor | None = None) -> dict[int, list[int]]:
        """Tokens each request commits, from the verify logits [B * (k+1), V]: every row
        sampled in one batched call (plain-greedy rows by `greedy`, the argmax when the step
        computed it), one device->host copy, then the prefix match per request."""
        rows = self.num_steps + 1
        sampling_rows = []
        for i, req in enumerate(batch.reqs):
            base = SamplingRow(req.params, req.prompt_ids, req.output_ids, req.sample_seed)
            sampling_rows += verify_rows(base, batch.draft_ids[i], rows)
        targets = sample_rows(logits, sampling_rows, greedy)
        return {req.rid: accept(targets[i * rows:(i + 1) * rows],
                                batch.draft_ids[i][:batch.num_drafts[i]])
                for i, req in enumerate(batch.reqs)}

    def on_forward(self, batch: Batch, hidden) -> None:
        self.proposer.on_forward(batch, hidden)

    def on_commit(self, batch: Batch, committed: list[int]) -> None:
        self.proposer.on_commit(batch, committed)

    def release(self, req: Req) -> None:
        self.proposer.release(req)
