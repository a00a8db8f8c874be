"""load_model: config.json + safetensors (single file or sharded index) -> Model.

Checkpoint keys are mapped onto `Model` parameter names (see `Model`'s docstring):
- prefixes `model.language_model.` / `language_model.model.` / `language_model.` / `model.` are
  dropped; `lm_head.*` and `mtp.*` are kept as they are; vision tower keys are skipped;
- `linear_attn.conv1d.weight` [D, 1, W] -> `linear_attn.conv_weight` [D, W];
- Qwen3-Next `linear_attn.in_proj_qkvz` / `in_proj_ba` -> the Qwen3.5 layout, reordered once
  (`split_qwen3_next_projections`);
- the projections a layer merges (model/merged.py: attention `q_proj|k_proj|v_proj`, GDN
  `in_proj_qkv|z|b|a`, MLP `gate_proj|up_proj`) -> their row range of the merged weight; the
  merged layout is logged once per load;
- per-expert `mlp.experts.N.{gate,up,down}_proj.weight` -> stacked `mlp.experts.gate_up_proj`
  [E, 2I, hidden] / `mlp.experts.down_proj` [E, hidden, I]; stacked checkpoints load directly.
Every parameter is cast to `dtype` (as transformers does), then the weights the fused ops read
prepared once (model/prepare.py). A missing tensor, a tensor of the wrong shape and (with
strict=True) an unexpected tensor raise ValueError naming it.
"""

from __future__ import annotations

import json
import logging
import re
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from deltaserve.model.config import ModelConfig
from deltaserve.model.dummy import fill_dummy
from deltaserve.model.gdn import split_qwen3_next_projections
from deltaserve.model.merged import merged_parts
from deltaserve.model.prepare import merged_layout, prepare_weights
from deltaserve.model.qwen3_5 import Model

TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
VISION_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.",
                   "model.multi_modal_projector.")
IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_GDN = re.compile(r"^(.*\.linear_attn)\.in_proj_(qkvz|ba)\.weight$")
logger = logging.getLogger("deltaserve.model")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


LOAD_FORMATS = ("auto", "dummy")


def load_model(path: str | Path, dtype: torch.dtype | str = torch.bfloat16,
               device: torch.device | str = "cpu", *, strict: bool = True,
               progress: bool = True, load_format: str = "auto", seed: int = 0) -> Model:
    """Build the model of checkpoint directory `path` on `device` with weights in `dtype`.

    The MTP head is built when the checkpoint has `mtp.*` tensors (as many layers as it holds);
    a config announcing MTP without such tensors loads without it (warning). strict=False turns
    the unexpected-tensor error into a warning. load_format "dummy" reads config.json alone and
    draws random weights on `device` from `seed` (model/dummy.py; the MTP layers the config
    announces are built). Returns the model in eval mode, without grads. Raises ValueError for
    an unknown load_format.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, "
                         f"got {load_format!r}")
    path = Path(path)
    dtype = _DTYPES[dtype] if isinstance(dtype, str) else dtype
    config = ModelConfig.from_pretrained(path)
    key_files = None if load_format == "dummy" else _index(path)
    num_mtp = config.mtp_num_hidden_layers if key_files is None else _num_mtp(path, config,
                                                                            key_files)
    with torch.device("meta"):
        model = Model(config, num_mtp_layers=num_mtp)
    model = model.to(dtype).to_empty(device=device)
    model.rotary.reset_inv_freq()
    if key_files is None:
        fill_dummy(model, seed)
    else:
        _Filler(model, config, key_files, path, strict, progress).run()
    prepare_weights(model)
    logger.info("%s: merged projections (one GEMM each): %s", path.name,
                "; ".join(merged_layout(model)))
    return model.requires_grad_(False).eval()


def _num_mtp(path: Path, config: ModelConfig, key_files: dict[str, Path]) -> int:
    """MTP layers the checkpoint holds (a config announcing more loads without them: warning)."""
    mtp_layers = {int(m.group(1)) for k in key_files if (m := re.match(r"mtp\.layers\.(\d+)\.", k))}
    num_mtp = max(mtp_layers) + 1 if mtp_layers else 0
    if num_mtp == 0 and config.mtp_num_hidden_layers > 0:
        warnings.warn(f"{path}: config announces {config.mtp_num_hidden_layers} MTP layer(s) "
                      "but the checkpoint has no mtp.* tensors; loading without MTP", stacklevel=3)
    return num_mtp


def _index(path: Path) -> dict[str, Path]:
    """Checkpoint key -> safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: path / f for k, f in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    out: dict[str, Path] = {}
    for f in files:
        try:
            with safe_open(f, framework="pt") as handle:
                out.update(dict.fromkeys(handle.keys(), f))
        except SafetensorError as e:  # truncated or not safetensors at all
            raise ValueError(f"{f}: not a readable safetensors file ({e})") from e
    return out


class _Filler:
    """Copies checkpoint tensors into the model's parameters and tracks what got filled.

    A parameter is complete when it was filled whole or piece by piece: for stacked experts the
    gate and up rows of every expert (gate_up_proj) or every expert (down_proj); for a merged
    projection the row range of every part.
    """

    def __init__(self, model: Model, config: ModelConfig, key_files: dict[str, Path],
                 path: Path, strict: bool, progress: bool) -> None:
        self.params = dict(model.named_parameters())
        self.config, self.key_files, self.path = config, key_files, path
        self.strict, self.progress = strict, progress
        self.whole: set[str] = set()
        self.pieces: dict[str, set[tuple[int, str]]] = {}
        self.unexpected: list[str] = []
        # checkpoint name of a merged part -> (merged parameter, first row, rows)
        self.merged = merged_parts(model)
        self.merged_parts: dict[str, list[str]] = {}  # merged parameter -> its parts' names
        for part, (target, _, _) in self.merged.items():
            self.merged_parts.setdefault(target, []).append(part)
        self.parts_filled: dict[str, set[str]] = {}
        self.pending_gdn: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
        self.text_prefix = next((p for p in TEXT_PREFIXES
                                 if any(k.startswith(p) for k in key_files)), "model.")
        self.per_expert = any(_EXPERT.match(_normalise(k)) for k in key_files)

    def run(self) -> None:
        by_file: dict[Path, list[str]] = {}
        for key, f in self.key_files.items():
            by_file.setdefault(f, []).append(key)
        # the bar goes with warnings: `--log-level error` asked for quiet (it was still drawn)
        quiet = not self.progress or not logger.isEnabledFor(logging.WARNING)
        with torch.no_grad(), tqdm(total=len(self.key_files), unit="tensor",
                                   desc=f"Loading {self.path.name}", disable=quiet) as bar:
            for f, keys in by_file.items():
                with safe_open(f, framework="pt") as handle:
                    for key in keys:
                        self._load(key, handle)
                        bar.update(1)
        for parts in self.pending_gdn.values():  # one of a qkvz / ba pair is absent
            (part, (key, _)), = parts.items()
            other = key.replace(f"in_proj_{part}.", "in_proj_ba." if part == "qkvz" else
                                "in_proj_qkvz.")
            raise ValueError(f"{self.path}: checkpoint is missing tensor {other}")
        self._check_complete()

    def _load(self, key: str, handle) -> None:
        if key.startswith(VISION_PREFIXES) or IGNORED.search(key):
            return
        name = _normalise(key)
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return  # tied: the embedding is the head (transformers ignores the copy too)
        if (m := _FUSED_GDN.match(name)) and self.config.fused_gdn_projections:
            pair = self.pending_gdn.setdefault(m.group(1), {})
            pair[m.group(2)] = (key, handle.get_tensor(key))
            if len(pair) == 2:
                self._load_fused_gdn(m.group(1), pair)
                del self.pending_gdn[m.group(1)]
            return
        if m := _EXPERT.match(name):
            self._load_expert(key, handle, m.group(1), int(m.group(2)), m.group(3))
            return
        if name.endswith(".linear_attn.conv1d.weight"):
            target = name.removesuffix("conv1d.weight") + "conv_weight"
            if target in self.params:
                d, w = self.params[target].shape
                self._copy(key, handle.get_tensor(key), target, (d, 1, w), lambda t: t[:, 0])
                return
        if name in self.merged:
            self._copy_part(key, handle.get_tensor(key), name)
            return
        if name not in self.params:
            self.unexpected.append(key)
            return
        self._copy(key, handle.get_tensor(key), name, tuple(self.params[name].shape))

    def _check_shape(self, key: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{self.path}: tensor {key} has shape {list(tensor.shape)}, "
                             f"expected {list(expected)}")

    def _copy_part(self, key: str, tensor: torch.Tensor, name: str) -> None:
        """Checkpoint tensor `key` (model name `name`) into its rows of a merged projection."""
        target, start, rows = self.merged[name]
        param = self.params[target]
        self._check_shape(key, tensor, (rows, *param.shape[1:]))
        param[start:start + rows].copy_(tensor)
        self.parts_filled.setdefault(target, set()).add(name)

    def _copy(self, key: str, tensor: torch.Tensor, target: str, expected: tuple[int, ...],
              transform=None, piece: tuple[int, str] | None = None) -> None:
        self._check_shape(key, tensor, expected)
        if transform is not None:
            tensor = transform(tensor)
        param = self.params[target]
        if piece is None:
            param.copy_(tensor)
            self.whole.add(target)
            return
        expert, part = piece
        inter = param.shape[1] // 2 if part != "down_proj" else None
        if part == "gate_proj":
            param[expert, :inter].copy_(tensor)
        elif part == "up_proj":
            param[expert, inter:].copy_(tensor)
        else:
            param[expert].copy_(tensor)
        self.pieces.setdefault(target, set()).add(piece)

    def _load_expert(self, key: str, handle, prefix: str, expert: int, part: str) -> None:
        target = f"{prefix}.{'down_proj' if part == 'down_proj' else 'gate_up_proj'}"
        if target not in self.params or expert >= self.params[target].shape[0]:
            self.unexpected.append(key)
            return
        shape = self.params[target].shape
        expected = (shape[1], shape[2]) if part == "down_proj" else (shape[1] // 2, shape[2])
        self._copy(key, handle.get_tensor(key), target, expected, piece=(expert, part))

    def _load_fused_gdn(self, prefix: str, pair: dict[str, tuple[str, torch.Tensor]]) -> None:
        c = self.config
        h, hv = c.linear_num_key_heads, c.linear_num_value_heads
        k, v = c.linear_key_head_dim, c.linear_value_head_dim
        if f"{prefix}.in_proj_qkv.weight" not in self.merged:
            self.unexpected.extend(key for key, _ in pair.values())
            return
        expected = {"qkvz": (2 * h * k + 2 * hv * v, c.hidden_size), "ba": (2 * hv, c.hidden_size)}
        for part, (key, tensor) in pair.items():
            self._check_shape(key, tensor, expected[part])
        split = split_qwen3_next_projections(pair["qkvz"][1], pair["ba"][1], h, hv, k, v)
        for name, tensor in split.items():
            key = pair["qkvz" if name in ("in_proj_qkv", "in_proj_z") else "ba"][0]
            self._copy_part(key, tensor, f"{prefix}.{name}.weight")

    def _check_complete(self) -> None:
        missing: list[str] = []
        for name, param in self.params.items():
            if name in self.whole:
                continue
            if name in self.merged_parts:
                got = self.parts_filled.get(name, set())
                missing += [self._checkpoint_name(p) for p in self.merged_parts[name]
                            if p not in got]
                continue
            got = self.pieces.get(name, set())
            if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                parts = ("down_proj",) if name.endswith("down_proj") else ("gate_proj", "up_proj")
                lack = [(e, p) for e in range(param.shape[0]) for p in parts if (e, p) not in got]
                base = self._checkpoint_name(name.rsplit(".", 1)[0])
                if got:
                    missing += [f"{base}.{e}.{p}.weight" for e, p in lack]
                    continue
                if self.per_expert:
                    last = param.shape[0] - 1
                    missing += [f"{base}.[0-{last}].{p}.weight" for p in parts]
                    continue
            missing.append(self._checkpoint_name(name))
        missing = list(dict.fromkeys(missing))
        if missing:
            shown = ", ".join(missing[:20]) + (f" (+{len(missing) - 20} more)"
                                                if len(missing) > 20 else "")
            raise ValueError(f"{self.path}: checkpoint is missing {len(missing)} tensor(s): "
                             f"{shown}")
        if self.unexpected:
            shown = ", ".join(sorted(self.unexpected)[:20])
            message = (f"{self.path}: checkpoint has {len(self.unexpected)} unexpected "
                       f"tensor(s): {shown}")
            if self.strict:
                raise ValueError(message + " (load_model(..., strict=False) to skip them)")
            warnings.warn(message, stacklevel=4)

    def _checkpoint_name(self, name: str) -> str:
        """The checkpoint key that would fill parameter `name` (for error messages)."""
        if name.endswith(".linear_attn.conv_weight"):
            name = name.removesuffix("conv_weight") + "conv1d.weight"
        elif self.config.fused_gdn_projections and (
                m := re.match(r"^(.*\.linear_attn)\.in_proj_(qkv|z|b|a)\.weight$", name)):
            name = f"{m.group(1)}.in_proj_{'qkvz' if m.group(2) in ('qkv', 'z') else 'ba'}.weight"
        if name.startswith(("lm_head.", "mtp.")):
            return name
        return self.text_prefix + name


def _normalise(key: str) -> str:
    for prefix in TEXT_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key
