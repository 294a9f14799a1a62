"""Sparse GGUF model files (macpool/sim/model_files.py), read back as the agent and the simulator do."""

from __future__ import annotations

from pathlib import Path

import pytest

from macpool.gguf_info import read_shape
from macpool.sim.model_files import write_model_gguf


def test_a_model_file_has_its_size_and_shape_and_takes_no_disk(tmp_path: Path) -> None:
    path = write_model_gguf(tmp_path / "big.gguf", weights_gb=40.5, layers=80, kv_heads=8, head_dim=128,
                            heads=64)
    shape = read_shape(path)
    assert (shape.architecture, shape.n_layers, shape.n_kv_heads) == ("llama", 80, 8)
    assert shape.weights_gb == 40.5 == path.stat().st_size / 1e9
    assert shape.kv_bytes_per_token() == 80 * 8 * 128 * 2 * 2
    assert path.stat().st_blocks * 512 < 1_000_000  # sparse: the weights are a hole


def test_a_model_file_smaller_than_its_header_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="weights_gb"):
        write_model_gguf(tmp_path / "tiny.gguf", weights_gb=1e-6)
    assert not (tmp_path / "tiny.gguf").exists()
