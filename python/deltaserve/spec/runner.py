"""SpecRunner: the engine's SpecRuntime. Asks the proposer for drafts, pads them to k, and
turns verify logits into committed tokens with exact rejection sampling."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from deltaserve.engine.sampling import SamplingRow, sample_rows
from deltaserve.engine.staging import to_device
from deltaserve.spec.accept import pack_greedy
from deltaserve.spec.proposer import Proposer
from deltaserve.spec.rejection import accept, verify_rows

if TYPE_CHECKING:
    from deltaserve.config import EngineConfig
    from deltaserve.core import Batch, Req
    from deltaserve.engine.cuda_graph import VerifyChain


class SpecRunner:
    """Drives one Proposer for verify steps of k+1 rows per request."""

    def __init__(self, proposer: Proposer, num_steps: int) -> None:
        self.proposer = proposer
        self.num_steps = num_steps

    @property
    def wants_hidden(self) -> bool:
        return self.proposer.wants_hidden

    @property
    def chains_verify(self) -> bool:
        """The proposer can draft for a verify step chained behind an unlanded one."""
        return self.proposer.chains_verify

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

    def use_graphs(self, max_reqs: int, max_kv_len: int, capture: bool = True) -> None:
        self.proposer.use_graphs(max_reqs, max_kv_len, capture)

    def propose(self, batch: Batch) -> None:
        k = self.num_steps
        drafts = self.proposer.propose(batch.reqs)
        if isinstance(drafts, torch.Tensor):  # k drafts per request, left on the device
            _device_drafts(batch, drafts, k)
            return
        batch.draft_tensor = None
        batch.draft_ids, batch.num_drafts = [], []
        for req, d in zip(batch.reqs, drafts):
            d = list(d[:k])
            batch.num_drafts.append(len(d))
            pad = d[-1] if d else req.tokens(req.num_tokens - 1, req.num_tokens)[0]
            batch.draft_ids.append(d + [pad] * (k - len(d)))

    def propose_chained(self, batch: Batch, chain: VerifyChain,
                        hidden: torch.Tensor | None) -> bool:
        """Drafts for a verify batch chained behind the previous verify step of the same
        requests (Proposer.propose_chained), left on the device in `batch.draft_tensor`;
        False when the proposer cannot make them so (nothing is changed)."""
        drafts = self.proposer.propose_chained(batch.reqs, chain, hidden)
        if drafts is None:
            return False
        _device_drafts(batch, drafts, self.num_steps)
        return True

    def accept(self, batch: Batch, logits: torch.Tensor, greedy: torch.Tensor | None = None,
               accepted: torch.Tensor | None = None) -> dict[int, list[int]]:
        """Tokens each request commits, from the verify logits [B * (k+1), V].

        All requests plain greedy (no penalties): acceptance on the device from the rows'
        argmax (`greedy` when the step computed it) and the drafts where they are
        (spec/accept.py), or the verify graph's own (`accepted`, ForwardOutput.accepted, only
        with `greedy`), then one device->host copy of the accepted counts and tokens. Otherwise
        every row is sampled in one batched call and matched per request on the host (the
        drafts copied to the host once when they were on the device)."""
        rows = self.num_steps + 1
        if all(_plain_greedy(req.params) for req in batch.reqs):
            return self._accept_greedy(batch, logits, greedy,
                                       accepted if greedy is not None else None)
        drafts = batch.host_drafts()
        sampling_rows = []
        for i, req in enumerate(batch.reqs):
            base = SamplingRow(req.params, req.prompt_ids, req.output_ids, req.sample_seed)
            sampling_rows += verify_rows(base, drafts[i], rows)
        targets = sample_rows(logits, sampling_rows, greedy)
        return {req.rid: accept(targets[i * rows:(i + 1) * rows],
                                drafts[i][:batch.num_drafts[i]])
                for i, req in enumerate(batch.reqs)}

    def _accept_greedy(self, batch: Batch, logits: torch.Tensor, greedy: torch.Tensor | None,
                       packed: torch.Tensor | None) -> dict[int, list[int]]:
        if packed is None:  # not computed in the verify graph: the same ops here
            k = self.num_steps
            if greedy is None:
                greedy = logits.argmax(dim=-1)
            drafts = batch.draft_tensor if batch.draft_ids is None else None
            if drafts is None:  # drafts made on the host (n-gram): one staged copy
                drafts = to_device(np.asarray(batch.draft_ids, dtype=np.int64).reshape(-1),
                                   torch.long, greedy.device).view(batch.size, k)
            num = None
            if any(n != k for n in batch.num_drafts):
                num = to_device(batch.num_drafts, torch.long, greedy.device)
            packed = pack_greedy(greedy, drafts, num)
        return {req.rid: row[1:row[0] + 2] for req, row in zip(batch.reqs, packed.tolist())}

    def on_forward(self, batch: Batch, hidden) -> None:
        self.proposer.on_forward(batch, hidden)

    def on_commit(self, batch: Batch, committed: list[int]) -> None:
        self.proposer.on_commit(batch, committed)

    def on_chained_commit(self, batch: Batch, committed: list[int]) -> None:
        self.proposer.on_chained_commit(batch, committed)

    def release(self, req: Req) -> None:
        self.proposer.release(req)


def _device_drafts(batch: Batch, drafts: torch.Tensor, k: int) -> None:
    """`batch` verifies k drafts per request held on the device (int64 [N, k])."""
    batch.draft_tensor, batch.draft_ids = drafts, None
    batch.num_drafts = [k] * batch.size


def _plain_greedy(p) -> bool:
    """Greedy without penalties: a row's token is its argmax alone, whatever the drafts."""
    return p.greedy and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 \
        and p.frequency_penalty == 0.0
