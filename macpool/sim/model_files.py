"""Model files for tests, benches and demos: GGUFs with a real model's attention shape and file size, and
no weights (the size is a hole in a sparse file, so a "70 GB model" takes no disk). The simulator and the
agent size a model from exactly these (macpool.gguf_info); a real llama-server cannot load them."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

CONTEXT_LENGTH = 32768  # the context the model was trained for (llama-server's n_ctx_train)


def write_model_gguf(
    path: Path, *, weights_gb: float, layers: int = 32, kv_heads: int = 8, head_dim: int = 128,
    heads: int = 32,
) -> Path:
    """Write a llama-architecture GGUF of ``weights_gb`` x 1e9 bytes (sparse) with this attention shape: its
    f16 KV cache takes ``layers x kv_heads x head_dim x 2 x 2`` bytes per token. Returns ``path``."""
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_embedding_length(heads * head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_tensor("token_embd.weight", np.zeros((1, heads * head_dim), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    size = round(weights_gb * 1e9)
    if size < path.stat().st_size:
        path.unlink()
        raise ValueError(f"weights_gb={weights_gb}: smaller than the GGUF's own header and tensor")
    os.truncate(path, size)
    return path
