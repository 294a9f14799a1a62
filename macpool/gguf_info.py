"""What the GGUF metadata says a request costs: KV-cache bytes per token, and the weights' size."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# bytes per element of llama.cpp's KV cache types (block types: block bytes / 32 elements)
CACHE_TYPE_BYTES: dict[str, float] = {
    "f32": 4.0,
    "f16": 2.0,
    "bf16": 2.0,
    "q8_0": 34 / 32,
    "q5_1": 24 / 32,
    "q5_0": 22 / 32,
    "q4_1": 20 / 32,
    "q4_0": 18 / 32,
    "iq4_nl": 18 / 32,
}


class GGUFError(ValueError):
    """The file is not a GGUF we can read the attention shape from."""


@dataclass(frozen=True)
class ModelShape:
    """The attention shape of a GGUF model, enough to size its KV cache."""

    path: Path
    architecture: str
    n_layers: int
    n_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    file_bytes: int
    n_ctx_train: int = 0  # the context the model was trained for (0: the file does not say)

    def kv_bytes_per_token(self, cache_type_k: str = "f16", cache_type_v: str = "f16") -> int:
        """layers x KV heads x (head dim K x bytes K + head dim V x bytes V)."""
        per_head = self.head_dim_k * _cache_bytes(cache_type_k) + self.head_dim_v * _cache_bytes(cache_type_v)
        return round(self.n_layers * self.n_kv_heads * per_head)

    @property
    def weights_gb(self) -> float:
        return self.file_bytes / 1e9


def _cache_bytes(cache_type: str) -> float:
    try:
        return CACHE_TYPE_BYTES[cache_type.lower()]
    except KeyError as exc:
        raise GGUFError(f"unknown KV cache type {cache_type!r}") from exc


def read_shape(path: Path) -> ModelShape:
    from gguf import GGUFReader  # heavy import (numpy); only when a model is given

    try:
        reader = GGUFReader(path, "r")
    except (ValueError, OSError) as exc:
        raise GGUFError(f"{path}: not a readable GGUF file ({exc})") from exc

    def field(key: str, default: Any = None) -> Any:
        found = reader.get_field(key)
        return default if found is None else found.contents()

    arch = field("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(f"{path}: no general.architecture")
    n_layers = _scalar(field(f"{arch}.block_count"), f"{arch}.block_count", path)
    n_heads = _scalar(field(f"{arch}.attention.head_count"), f"{arch}.attention.head_count", path)
    n_kv = field(f"{arch}.attention.head_count_kv", n_heads)
    n_embd = _scalar(field(f"{arch}.embedding_length"), f"{arch}.embedding_length", path)
    head_k = field(f"{arch}.attention.key_length") or n_embd // n_heads
    head_v = field(f"{arch}.attention.value_length") or n_embd // n_heads
    return ModelShape(
        path=path,
        architecture=arch,
        n_layers=n_layers,
        n_kv_heads=_scalar(n_kv, "head_count_kv", path),
        head_dim_k=int(head_k),
        head_dim_v=int(head_v),
        file_bytes=path.stat().st_size,
        n_ctx_train=int(field(f"{arch}.context_length", 0) or 0),
    )


def _scalar(value: Any, key: str, path: Path) -> int:
    # per-layer arrays (some architectures vary heads by layer): size for the largest layer
    if isinstance(value, list):
        value = max(value) if value else None
    if value is None:
        raise GGUFError(f"{path}: no {key}")
    return int(value)


def cache_types(llama_args: list[str]) -> tuple[str, str]:
    """The KV cache types llama-server will use, from its extra arguments (default f16/f16)."""
    k, v = "f16", "f16"
    for flag, value in itertools.pairwise([*llama_args, ""]):
        if flag in ("-ctk", "--cache-type-k"):
            k = value
        elif flag in ("-ctv", "--cache-type-v"):
            v = value
    return k, v
