"""n choices of one prompt (OpenAI `n > 1`) as forks of one prefill through the prefix cache.

A hidden *parent* request (negative rid, greedy, one output token) prefills the prompt; when it
finishes, the prefix cache holds the prompt's full pages and its GDN snapshots (every prefill
chunk end and the prompt's last 64-token boundary), and only then are the n choices admitted:
each resumes from the deepest snapshot and recomputes at most the prompt's tail past it (under
64 tokens and a page). The parent's output is never reported. Without a prefix cache, or for a
prompt too short to hold a snapshot, the choices are admitted at once.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from deltaserve.core import SamplingParams

if TYPE_CHECKING:
    from deltaserve.core import Req
    from deltaserve.engine.llm_engine import RequestOutput


def parent_params() -> SamplingParams:
    """The hidden parent's parameters: one greedy token (its logits row is the only cost)."""
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


class ForkGroups:
    """Choices held back until their parent's prompt is in the prefix cache.

    `admit(req)` is the engine's way to queue a request (scheduler add + bookkeeping).
    """

    def __init__(self, admit) -> None:
        self._admit = admit
        self._held: dict[int, list[Req]] = {}  # parent rid -> held choices
        self._parent_rids = itertools.count(-1, -1)  # never a caller's rid (those are >= 0)

    def new_parent_rid(self) -> int:
        return next(self._parent_rids)

    def hold(self, parent_rid: int, choices: list[Req]) -> None:
        """Keep `choices` out of the scheduler until request `parent_rid` finishes."""
        self._held[parent_rid] = list(choices)

    def is_held(self, rid: int) -> bool:
        return any(r.rid == rid for group in self._held.values() for r in group)

    def drop(self, rid: int) -> int | None:
        """Forget held choice `rid`; returns its parent's rid when no choice is left (the
        caller aborts the parent then), else None."""
        for parent, group in self._held.items():
            if any(r.rid == rid for r in group):
                group[:] = [r for r in group if r.rid != rid]
                if not group:
                    del self._held[parent]
                    return parent
                return None
        return None

    def on_outputs(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Remove the parents' outputs from `outputs`; admit the choices of finished parents."""
        if not self._held:
            return outputs
        kept = []
        for out in outputs:
            if out.rid not in self._held:
                kept.append(out)
                continue
            if out.finished:
                for req in self._held.pop(out.rid):
                    self._admit(req)
        return kept
