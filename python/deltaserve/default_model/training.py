"""Training pieces for the default model: token streams, batches, the loss, evaluation.

Used by scripts/train_default_model.py and its tests. The model is transformers'
`Qwen3_5ForCausalLM` (fla-core's chunked gated-delta-rule kernels on CUDA, its pure-torch
reference on CPU) plus an `MTPHead`; the loss is next-token cross-entropy plus `mtp_weight`
times the mean cross-entropy of `mtp_steps` recursive MTP drafting steps.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import nn
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from deltaserve.default_model.corpus import iter_split
from deltaserve.default_model.mtp import MTPHead, greedy_first_draft_agreement, mtp_losses
from deltaserve.default_model.tokenizer import EOS_TOKEN


def tokenize_split(tokenizer_json: str | os.PathLike, corpus_dir: str, split: str,
                   cache_dir: str | os.PathLike | None = None) -> torch.Tensor:
    """The split's documents encoded and concatenated, each followed by <|endoftext|>.

    Returns a 1-D int32 tensor (token ids), in corpus order. With `cache_dir`, the ids are
    kept there in a file named by the SHA-256 of the tokenizer file and of the split's shards,
    and read back instead of encoding again (a resumed run: minutes on a few cores).
    """
    cache = None
    if cache_dir is not None:
        h = hashlib.sha256(Path(tokenizer_json).read_bytes())
        for shard in sorted(Path(corpus_dir).glob(f"{split}-*.jsonl")):
            h.update(shard.name.encode() + shard.read_bytes())
        cache = Path(cache_dir) / f"tokens-{split}-{h.hexdigest()[:16]}.pt"
        if cache.exists():
            return torch.load(cache, weights_only=True)
    tok = Tokenizer.from_file(str(tokenizer_json))
    eos = tok.token_to_id(EOS_TOKEN)
    texts = [doc.text for doc in iter_split(corpus_dir, split)]
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    out = torch.tensor(ids, dtype=torch.int32)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(out, cache.with_suffix(".tmp"))
        cache.with_suffix(".tmp").replace(cache)
    return out


def train_batches(
    stream: torch.Tensor, batch_size: int, seq_len: int, seed: int, skip: int = 0
) -> Iterator[torch.Tensor]:
    """Endless [batch_size, seq_len] int64 batches of windows of the token stream.

    Each epoch cuts the stream into non-overlapping windows of seq_len tokens, starting at an
    offset (0 in epoch 0, then drawn in [0, seq_len)) so later epochs see other cut points, and
    visits every window once in an order drawn from a generator seeded with (seed, epoch).
    The first `skip` batches are passed over without being gathered (a resumed run).
    """
    if (stream.numel() - seq_len) // seq_len < batch_size:
        raise ValueError(f"{stream.numel()} tokens are too few for batches of {batch_size} x "
                         f"{seq_len}")
    epoch = 0
    while True:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        offset = int(torch.randint(seq_len, (1,), generator=gen)) if epoch else 0
        n_windows = (stream.numel() - offset) // seq_len
        windows = stream[offset : offset + n_windows * seq_len].view(n_windows, seq_len)
        order = torch.randperm(n_windows, generator=gen)
        for i in range(0, n_windows - batch_size + 1, batch_size):
            if skip:
                skip -= 1
                continue
            yield windows[order[i : i + batch_size]].long()
        epoch += 1


def lr_at(step: int, max_steps: int, lr: float, warmup: int, min_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to `min_ratio * lr` at max_steps."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class TrainModel(nn.Module):
    """The target model and its MTP head, trained together."""

    def __init__(self, config: Qwen3_5TextConfig, mtp_fraction: float = 1.0):
        super().__init__()
        if not 0.0 < mtp_fraction <= 1.0:
            raise ValueError(f"mtp_fraction must be in (0, 1], got {mtp_fraction}")
        # the MTP losses train on the batch's first ceil(fraction x B) rows: each MTP step
        # costs a decoder layer plus the lm_head, so three steps on every row cost about as
        # much as the whole target model, for a head of 1.9 M parameters
        self.mtp_fraction = mtp_fraction
        self.lm = Qwen3_5ForCausalLM(config)
        self.mtp = MTPHead(self.lm.config)
        self.mtp.apply(self.lm._init_weights)  # same initialisation as the target's layers

    def forward(self, input_ids: torch.Tensor, mtp_steps: int) -> tuple[torch.Tensor, list]:
        """(next-token loss, [loss of MTP step d for d = 1..mtp_steps]) for [B, T] ids; the
        MTP losses over the first ceil(mtp_fraction x B) rows."""
        hidden = self.lm.model(input_ids=input_ids, use_cache=False).last_hidden_state
        logits = self.lm.lm_head(hidden[:, :-1]).float()
        main = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1))
        rows = math.ceil(self.mtp_fraction * input_ids.shape[0])
        return main, mtp_losses(self.lm, self.mtp, input_ids[:rows], hidden[:rows], mtp_steps)

    def param_counts(self) -> dict[str, int]:
        """Parameters of the target model (tied embedding once) and of the MTP head."""
        return {
            "model": sum(p.numel() for p in self.lm.parameters()),
            "mtp": sum(p.numel() for p in self.mtp.parameters()),
        }


def make_optimizer(model: TrainModel, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW; matrices (and the embedding) decay, norms and the GDN gate vectors do not."""
    decay, no_decay = [], []
    for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


@dataclass(slots=True)
class StepResult:
    """Losses of one optimiser step (floats, nats per token) and the gradient norm."""

    loss: float
    main: float
    mtp: list[float]
    grad_norm: float


def train_step(
    model: TrainModel,
    opt: torch.optim.Optimizer,
    batch: torch.Tensor,
    *,
    lr: float,
    mtp_steps: int,
    mtp_weight: float,
    grad_clip: float,
    autocast_dtype: torch.dtype | None,
    micro_batches: int = 1,
) -> StepResult:
    """One optimiser step on `batch` [B, T] (already on the model's device); sets lr first.

    `micro_batches` > 1 accumulates the gradient over that many equal slices of the batch
    (same update as one pass, up to float summation order; less activation memory).
    Raises ValueError when B is not a multiple of micro_batches.
    """
    if batch.shape[0] % micro_batches:
        raise ValueError(f"batch of {batch.shape[0]} rows does not split into {micro_batches}")
    for group in opt.param_groups:
        group["lr"] = lr
    device_type = batch.device.type
    opt.zero_grad(set_to_none=True)
    totals = None
    for part in batch.chunk(micro_batches):
        with torch.autocast(device_type, dtype=autocast_dtype or torch.float32,
                            enabled=autocast_dtype is not None):
            main, mtps = model(part, mtp_steps)
            loss = main + mtp_weight * torch.stack(mtps).mean() if mtps else main
        (loss / micro_batches).backward()
        vals = torch.stack([loss.detach(), main.detach(), *[m.detach() for m in mtps]])
        totals = vals if totals is None else totals + vals
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    loss, main, *mtp = (totals / micro_batches).tolist()
    return StepResult(loss, main, mtp, grad_norm.item())


def mix_streams(stdlib: torch.Tensor, extra: torch.Tensor | None,
                stdlib_repeat: int) -> torch.Tensor:
    """The training stream: the stdlib tokens `stdlib_repeat` times, then the extra split's.

    1-D int32 in, 1-D int32 out. `train_batches` shuffles windows of it every epoch, so the
    repeat only sets the share of stdlib text (the held-out split's own distribution).
    """
    if stdlib_repeat < 1:
        raise ValueError(f"stdlib_repeat must be >= 1, got {stdlib_repeat}")
    parts = [stdlib] * stdlib_repeat + ([extra] if extra is not None and extra.numel() else [])
    return torch.cat(parts)


@torch.no_grad()
def evaluate(
    model: TrainModel,
    stream: torch.Tensor,
    *,
    seq_len: int,
    batch_size: int,
    mtp_steps: int,
    autocast_dtype: torch.dtype | None,
    max_tokens: int = 0,
) -> dict:
    """Held-out metrics over non-overlapping seq_len windows of `stream` (all, or max_tokens).

    Returns loss (mean next-token cross-entropy, nats), ppl = exp(loss), mtp_loss (per step)
    and draft1_agreement: the fraction of positions where the first MTP draft's argmax equals
    the target's argmax (teacher-forced greedy acceptance rate of draft 1).
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    n_windows = (stream.numel() - 1) // seq_len
    if n_windows < 1:
        raise ValueError(f"{stream.numel()} held-out tokens: fewer than seq_len + 1")
    if max_tokens:
        n_windows = min(n_windows, max(1, max_tokens // seq_len))
    windows = stream[: n_windows * seq_len].view(n_windows, seq_len).long()
    tot_main, tot_mtp, agree, rows, n = 0.0, [0.0] * mtp_steps, 0, 0, 0
    for i in range(0, n_windows, batch_size):
        batch = windows[i : i + batch_size].to(device)
        with torch.autocast(device.type, dtype=autocast_dtype or torch.float32,
                            enabled=autocast_dtype is not None):
            hidden = model.lm.model(input_ids=batch, use_cache=False).last_hidden_state
            logits = model.lm.lm_head(hidden).float()
            main = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                   batch[:, 1:].reshape(-1))
            mtps = mtp_losses(model.lm, model.mtp, batch, hidden, mtp_steps)
            a, r = greedy_first_draft_agreement(model.lm, model.mtp, batch, hidden, logits)
        w = batch.shape[0]
        tot_main += main.item() * w
        tot_mtp = [t + m.item() * w for t, m in zip(tot_mtp, mtps, strict=True)]
        agree, rows, n = agree + a, rows + r, n + w
    model.train(was_training)
    loss = tot_main / n
    return {
        "loss": loss,
        "ppl": math.exp(loss),
        "mtp_loss": [t / n for t in tot_mtp],
        "draft1_agreement": agree / rows,
        "tokens": n * (seq_len - 1),
    }


def save_checkpoint(path: str | os.PathLike, model: TrainModel, opt: torch.optim.Optimizer,
                    meta: dict) -> None:
    """Write the model's and optimiser's state and `meta` (step, schedule, log: plain Python
    values) to `path` atomically (a temporary sibling renamed into place)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "meta": meta}, tmp)
    tmp.replace(path)


def load_checkpoint(path: str | os.PathLike, model: TrainModel, opt: torch.optim.Optimizer,
                    expect: dict) -> dict:
    """Restore `model` and `opt` from a `save_checkpoint` file; return its meta.

    Raises FileNotFoundError when there is none, ValueError when the meta's "run" entry
    differs from `expect` (another architecture, batch, schedule or seed: resuming would
    silently train a different run).
    """
    state = torch.load(path, map_location=next(model.parameters()).device, weights_only=True)
    meta = state["meta"]
    if meta["run"] != expect:
        diff = {k: (meta["run"].get(k), v) for k, v in expect.items() if meta["run"].get(k) != v}
        raise ValueError(f"{path} is another run's checkpoint (checkpoint, now): {diff}")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    return meta
