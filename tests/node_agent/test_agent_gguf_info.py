"""KV bytes per token from GGUF metadata, on a GGUF written here."""

from __future__ import annotations

from pathlib import Path

import pytest

from macpool.gguf_info import GGUFError, cache_types, read_shape
from tests.node_agent.helpers import write_gguf


def test_kv_bytes_per_token_f16_and_quantised(tmp_path: Path) -> None:
    # a 14B-class shape: 48 layers, 8 KV heads of 128 -> 196,608 bytes/token in f16
    shape = read_shape(write_gguf(tmp_path / "m.gguf", layers=48, heads=40, kv_heads=8, embd=5120))
    assert (shape.n_layers, shape.n_kv_heads, shape.head_dim_k) == (48, 8, 128)
    assert shape.kv_bytes_per_token() == 48 * 8 * 128 * 2 * 2
    assert shape.kv_bytes_per_token("q8_0", "q8_0") == round(48 * 8 * 128 * 2 * 34 / 32)
    assert shape.weights_gb == pytest.approx((tmp_path / "m.gguf").stat().st_size / 1e9)


def test_explicit_key_length_wins(tmp_path: Path) -> None:
    shape = read_shape(write_gguf(tmp_path / "k.gguf", layers=2, heads=4, kv_heads=2, embd=64, key_length=32))
    assert shape.kv_bytes_per_token() == 2 * 2 * (32 * 2 + 32 * 2)


def test_matches_the_tiny_model_generator() -> None:
    tiny_model = pytest.importorskip("macpool.dev.tiny_model")
    path = tiny_model.ensure("tiny")
    assert read_shape(path).kv_bytes_per_token() == tiny_model.kv_bytes_per_token(path)


def test_not_a_gguf(tmp_path: Path) -> None:
    bogus = tmp_path / "x.gguf"
    bogus.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(GGUFError):
        read_shape(bogus)


def test_cache_types_from_llama_server_args() -> None:
    assert cache_types([]) == ("f16", "f16")
    assert cache_types(["-ctk", "q8_0", "--cache-type-v", "q4_0", "-fa", "on"]) == ("q8_0", "q4_0")
