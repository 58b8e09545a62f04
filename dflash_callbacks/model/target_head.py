"""The target's input embedding and LM head, read straight from its safetensors files.

Scoring a drafter needs only these two matrices of the (large) target. They are read
tensor by tensor from the shard that holds them; no other tensor of the target is
read and the target model is never instantiated.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from torch import nn

from .attention import vllm_model_window
from .io import INDEX_FILE, open_safetensors, read_weight_map, safetensors_files

EMBED_KEYS = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "embed_tokens.weight",
)
LM_HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight")
HEAD_DTYPES = ("F32", "BF16", "F16")
"""safetensors dtypes of an embedding or LM head that can be read as they are."""
FINGERPRINT_ROWS = 64
"""Rows of each head tensor `head_fingerprint` reads, evenly spaced from the first to the last."""


def tie_word_embeddings(config: dict) -> bool:
    """Multimodal wrappers keep the text model's settings in text_config."""
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    text = config.get("text_config")
    return isinstance(text, dict) and bool(text.get("tie_word_embeddings", False))


def read_target_config(folder: Path) -> dict:
    """The target's config.json ({} without one); ValueError naming the file when it is not a JSON object."""
    file = folder / "config.json"
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text())
    except ValueError as e:  # not JSON, or not UTF-8
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} is not a JSON object (found {type(config).__name__})")
    return config


def target_model_window(target: str | os.PathLike) -> int | None:
    """The window vLLM's engine gives a drafter layer that declares none when serving the target folder `target`
    (`attention.vllm_model_window` of its config.json); None where it has none, or its config can not be read
    (the target's checks say why)."""
    try:
        return vllm_model_window(read_target_config(Path(target)))
    except (OSError, ValueError):
        return None


def locate_keys(folder: Path) -> dict[str, Path]:
    """Which file holds each tensor name: from the shard index when there is one,
    else from the headers of the folder's safetensors files (headers only)."""
    index = folder / INDEX_FILE
    if index.is_file():
        return {key: folder / name for key, name in read_weight_map(index).items()}
    where = {}
    for file in safetensors_files(folder):
        with open_safetensors(file) as f:
            where.update((key, file) for key in f.keys())
    return where


class TargetHead(nn.Module):
    """`embed_tokens` (nn.Embedding [V, H]) and `lm_head` (nn.Linear H -> V, no bias),
    holding the given tensors themselves. Nothing is initialised on the way (the LM head is
    built on the meta device, then given its weight): building a head draws nothing from
    the global RNG and allocates nothing in the default dtype, so it can run beside a
    seeded training run."""

    def __init__(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
        super().__init__()
        if embed_weight.shape[1] != lm_head_weight.shape[1]:
            raise ValueError(
                f"embedding width {embed_weight.shape[1]} != LM head width {lm_head_weight.shape[1]}"
            )
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight, freeze=True)
        self.lm_head = nn.Linear(lm_head_weight.shape[1], lm_head_weight.shape[0], bias=False, device="meta",
                                 dtype=lm_head_weight.dtype)
        self.lm_head.weight = nn.Parameter(lm_head_weight, requires_grad=False)
        self.source: str | None = None
        self.fingerprint: str | None = None  # head_fingerprint of the folder it was read from
        self.model_window: int | None = None  # the window vLLM gives a drafter layer without one (attention.py)

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.lm_head.weight.shape[1]

    @classmethod
    def from_pretrained(
        cls,
        target_path: str | os.PathLike,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
    ) -> "TargetHead":
        folder, where, embed_key, head_key = _locate_head(target_path)

        def read(key: str) -> torch.Tensor:
            with open_safetensors(where[key]) as f:
                return f.get_tensor(key).to(device=device, dtype=dtype)

        embed = read(embed_key)
        head_weight = read(head_key) if head_key is not None else embed
        head = cls(embed, head_weight)
        head.source = str(folder)
        head.fingerprint = head_fingerprint(folder)
        head.model_window = target_model_window(folder)
        return head.eval()


def _locate_head(target_path: str | os.PathLike) -> tuple[Path, dict[str, Path], str, str | None]:
    """(folder, file of every tensor, embedding key, LM head key or None when tied)."""
    folder = Path(target_path)
    if folder.is_file():
        raise FileNotFoundError(f"target {folder} is a file: give the target model's folder (e.g. {folder.parent})")
    if not folder.is_dir():
        raise FileNotFoundError(f"target folder {folder} does not exist")
    config = read_target_config(folder)
    where = locate_keys(folder)
    embed_key = next((k for k in EMBED_KEYS if k in where), None)
    if embed_key is None:
        raise ValueError(f"no input embedding in {folder}; looked for {list(EMBED_KEYS)} (is it a target model folder?)")
    head_key = next((k for k in LM_HEAD_KEYS if k in where), None)
    if head_key is None and not tie_word_embeddings(config):
        raise ValueError(
            f"no LM head in {folder}: none of {list(LM_HEAD_KEYS)} is stored and config.json "
            f"does not set tie_word_embeddings: true"
        )
    for key in {embed_key, head_key} - {None}:
        with open_safetensors(where[key]) as f:
            if key not in f.keys():
                raise ValueError(f"{folder / INDEX_FILE} says {where[key].name} holds {key!r}, but that file does not")
            tensor = f.get_slice(key)
            if len(tensor.get_shape()) != 2:
                raise ValueError(f"{key!r} in {where[key]} has shape {tensor.get_shape()}; a matrix "
                                 f"[vocabulary, hidden size] was expected")
            if tensor.get_dtype() not in HEAD_DTYPES:  # a quantized head: its values mean nothing without scales
                raise ValueError(f"{key!r} in {where[key]} is {tensor.get_dtype()}; the embedding and LM head must be "
                                 f"one of {list(HEAD_DTYPES)} (a quantized head can not be read as it is)")
    return folder, where, embed_key, head_key


def head_shapes(target_path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """{"embed_tokens": shape, "lm_head": shape} from the file headers alone (no tensor is read)."""
    _, where, embed_key, head_key = _locate_head(target_path)
    shapes = {}
    for name, key in (("embed_tokens", embed_key), ("lm_head", head_key or embed_key)):
        with open_safetensors(where[key]) as f:
            shapes[name] = tuple(f.get_slice(key).get_shape())
    return shapes


def head_fingerprint(target_path: str | os.PathLike) -> str:
    """16 hex digits naming the target's embedding and LM head: sha256 over each one's tensor
    name, shape, dtype and FINGERPRINT_ROWS evenly spaced rows, read through `safe_open`
    (a few rows, never a whole tensor: milliseconds for a 248k x 5120 head). Two heads of
    the same shapes with other weights (a re-trained or re-quantised target) differ; a
    change confined to rows it does not read goes unseen."""
    _, where, embed_key, head_key = _locate_head(target_path)
    digest = hashlib.sha256()
    for name, key in (("embed_tokens", embed_key), ("lm_head", head_key or embed_key)):
        with open_safetensors(where[key]) as f:
            tensor = f.get_slice(key)
            shape, dtype = tensor.get_shape(), tensor.get_dtype()
            digest.update(json.dumps([name, key, shape, dtype]).encode())
            count = min(FINGERPRINT_ROWS, shape[0])
            for row in sorted({i * (shape[0] - 1) // max(count - 1, 1) for i in range(count)}):
                digest.update(tensor[row : row + 1].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]
