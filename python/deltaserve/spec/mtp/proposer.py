"""MTP proposer: the checkpoint's multi-token-prediction head drafts k tokens per request.

The head at position j reads (t_{j+1}, h_j), h_j the target's final hidden state at j, and
predicts t_{j+2} (DESIGN.md, "Models"). Its attention layer keeps KV in a draft pool indexed by
the target's page indices, so the prefix cache (with lookahead keys: the draft KV at j depends
on t_{j+1}) serves both.

Per request the proposer keeps `mtp_len`, the positions whose draft KV is exact, and the target
hidden states of the positions after it. `_catch_up` runs the head over every position whose
next token is known (after a prefill chunk, after a verify commits, before a finished request's
pages go to the cache); its last row at position device_len - 1 yields the first draft. Drafts
2..k chain the head's own output hidden state one position further each step (their KV is
speculative and is rewritten by the next catch-up).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from deltaserve.core import FinishReason, ForwardContext, Phase
from deltaserve.engine.attention import AttentionMetadata, PagedAttentionBackend
from deltaserve.spec.proposer import Proposer

if TYPE_CHECKING:
    from deltaserve.core import Batch, Req


@dataclass
class _ReqState:
    mtp_len: int  # draft KV is exact for positions < mtp_len
    pending: list[torch.Tensor] = field(default_factory=list)  # h_j, j >= mtp_len, [n, H]
    first: tuple[torch.Tensor, int] | None = None  # (head output at device_len-1, its draft)
    first_at: int = -1  # the device_len `first` was computed for


class MTPProposer(Proposer):
    """k autoregressive argmax drafts from `model.mtp` (see module doc)."""

    wants_hidden = True

    def __init__(self, model, runner, num_steps: int, cfg) -> None:
        self.model, self.head = model, model.mtp
        self.kv = runner.draft_kv
        self.device = runner.device
        self.num_steps = num_steps
        self.states: dict[int, _ReqState] = {}
        self._verify_hidden: torch.Tensor | None = None

    # ---- hooks --------------------------------------------------------------------------
    def on_forward(self, batch: Batch, hidden: torch.Tensor | None) -> None:
        if batch.phase is Phase.VERIFY:
            self._verify_hidden = hidden
            return
        off = 0
        for req, n in zip(batch.reqs, batch.extend_lens):
            st = self.states.setdefault(req.rid, _ReqState(mtp_len=req.device_len))
            st.pending.append(hidden[off:off + n])
            off += n
        self._catch_up(batch.reqs)

    def on_commit(self, batch: Batch, committed: list[int]) -> None:
        rows = batch.rows_per_req
        for i, (req, c) in enumerate(zip(batch.reqs, committed)):
            if c and req.rid in self.states:
                self.states[req.rid].pending.append(self._verify_hidden[i * rows:i * rows + c])
        self._verify_hidden = None
        self._catch_up([r for r, c in zip(batch.reqs, committed) if c])

    def release(self, req: Req) -> None:
        if req.finish_reason is not FinishReason.ABORT and req.rid in self.states:
            self._catch_up([req])  # the cache keeps this request's draft KV: make it exact
        self.states.pop(req.rid, None)

    # ---- drafting -----------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, reqs: list[Req]) -> list[list[int]]:
        self._catch_up(reqs)
        drafts, hidden, tokens, live = [], [], [], []
        for i, req in enumerate(reqs):
            st = self.states.get(req.rid)
            if st is None or st.first is None or st.first_at != req.device_len:
                drafts.append([])
                continue
            h, tok = st.first
            drafts.append([tok])
            hidden.append(h)
            tokens.append(tok)
            live.append(i)
        if not live or self.num_steps == 1:
            return drafts
        # Drafts 2..k stay on the device between steps (one host sync for all of them, so
        # the launches of step i+1 are enqueued while step i runs).
        sub = [reqs[i] for i in live]
        h = torch.stack(hidden)
        tok = torch.tensor(tokens, dtype=torch.long, device=h.device)
        steps = []
        for step in range(1, self.num_steps):
            starts = [r.device_len + step - 1 for r in sub]
            h = self._run(sub, starts, [1] * len(sub), tok, h)
            tok = torch.argmax(self.model.compute_logits(h), dim=-1)
            steps.append(tok)
        for j, row in enumerate(torch.stack(steps, dim=1).tolist()):
            drafts[live[j]].extend(row)
        return drafts

    def _catch_up(self, reqs: list[Req]) -> None:
        """Run the head over each request's positions [mtp_len, len(all_ids) - 1)."""
        todo, starts, lens, ids, hid = [], [], [], [], []
        for req in reqs:
            st = self.states.get(req.rid)
            if st is None or not st.pending:
                continue
            have = torch.cat(st.pending) if len(st.pending) > 1 else st.pending[0]
            n = min(have.shape[0], req.num_tokens - 1 - st.mtp_len)
            if n <= 0:
                continue
            todo.append(req)
            starts.append(st.mtp_len)
            lens.append(n)
            ids.extend(req.tokens(st.mtp_len + 1, st.mtp_len + 1 + n))
            hid.append(have[:n])
            st.pending = [have[n:]] if have.shape[0] > n else []
        if not todo:
            return
        with torch.inference_mode():
            out = self._run(todo, starts, lens, ids, torch.cat(hid))
            ends = torch.tensor(lens, device=out.device).cumsum(0) - 1
            last = out[ends]
            first = torch.argmax(self.model.compute_logits(last), dim=-1).tolist()
        for j, (req, start, n) in enumerate(zip(todo, starts, lens)):
            st = self.states[req.rid]
            st.mtp_len = start + n
            st.first, st.first_at = (last[j], first[j]), st.mtp_len

    def _run(self, reqs: list[Req], starts: list[int], lens: list[int],
             ids: list[int] | torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """One MTP forward: rows of request i at positions starts[i] .. starts[i]+lens[i]-1;
        ids: the token after each row (a list, or a long tensor already on the device)."""
        dev = self.device
        meta = AttentionMetadata.build([r.page_table for r in reqs], starts, lens,
                                       self.kv.page_size, dev)
        positions = [p for s, n in zip(starts, lens) for p in range(s, s + n)]
        ctx = ForwardContext(positions=torch.tensor(positions, dtype=torch.long, device=dev),
                             attn=PagedAttentionBackend(self.kv, meta), gdn=None)
        if not isinstance(ids, torch.Tensor):
            ids = torch.tensor(ids, dtype=torch.long, device=dev)
        return self.head(ids, hidden, ctx)
