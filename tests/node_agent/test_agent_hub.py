"""Models from Hugging Face (node_agent/hub.py), through ``macpool agent fetch`` - a process of its own, with
its own HF_HOME, against a fake hub on loopback (tests/node_agent/fake_hub.py): the quant chosen as llama.cpp
chooses it, split files, a cut download resumed, a corrupted one refused, the token sent, the cache used
offline."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from macpool.dev import tiny_model
from macpool.dev.procs import macpool_argv
from node_agent.hub import HubRef, choose_files, parse_ref
from tests.inprocess import LocalStack
from tests.node_agent.fake_hub import FakeHub

REPO = "macpool/tiny-GGUF"


def fetch(hub_url: str, home: Path, ref: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {"PATH": "/usr/bin:/bin", "HOME": str(home), "HF_HOME": str(home / "hf"),
                   "HF_ENDPOINT": hub_url, "HF_HUB_DISABLE_TELEMETRY": "1", **env}
    return subprocess.run(macpool_argv("agent", "fetch", ref), capture_output=True, text=True, timeout=120,
                          env=environment)


def test_references_read_as_llama_cpp_takes_them() -> None:
    assert parse_ref("Qwen/Qwen3-8B-GGUF:Q4_K_M") == HubRef(repo="Qwen/Qwen3-8B-GGUF", quant="Q4_K_M")
    assert parse_ref("hf.co/org/repo:q8_0") == HubRef(repo="org/repo", quant="q8_0")
    assert parse_ref("org/repo/sub/m-Q4_0.gguf") == HubRef(repo="org/repo", file="sub/m-Q4_0.gguf")
    assert parse_ref("org/repo") == HubRef(repo="org/repo")
    for path in ("models/m.gguf", "m.gguf", "a b/c:Q4"):
        assert parse_ref(path) is None


def test_the_quant_is_chosen_as_llama_cpp_chooses_it() -> None:
    names = ["README.md", "m-Q8_0.gguf", "m-Q4_K_M.gguf", "mmproj-m-Q4_K_M.gguf", "m-IQ4_XS.gguf",
             *(f"big/m-Q6_K-0000{i}-of-00003.gguf" for i in (2, 1, 3))]
    assert choose_files(names, "Q4_K_M") == ["m-Q4_K_M.gguf"]  # never the projector
    assert choose_files(names, "q8_0") == ["m-Q8_0.gguf"]
    assert choose_files(names, "") == ["m-Q4_K_M.gguf"]  # no quant: Q4_K_M first
    assert choose_files(names, "Q6_K") == [f"big/m-Q6_K-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert choose_files(names, "Q2_K") == []
    assert choose_files(["x.gguf", "y-F16.gguf"], "") == ["x.gguf"]  # no default quant: the first


@pytest.fixture
def tiny() -> bytes:
    return tiny_model.ensure("tiny").read_bytes()


def test_a_split_quant_is_downloaded_whole_and_the_token_sent(local_stack: LocalStack, tmp_path: Path,
                                                              tiny: bytes) -> None:
    parts = {f"m-Q4_K_M-0000{i}-of-00002.gguf": bytes([i]) * 1000 for i in (1, 2)}
    hub = FakeHub({REPO: {"m-Q8_0.gguf": tiny, **parts}})
    served = local_stack.serve("hub", hub.app(), ready=None)
    done = fetch(served.url, tmp_path, f"{REPO}:Q4_K_M", HF_TOKEN="hf_secret")
    assert done.returncode == 0, done.stderr
    first = Path(done.stdout.strip())
    assert first.name == "m-Q4_K_M-00001-of-00002.gguf"
    second = "m-Q4_K_M-00002-of-00002.gguf"
    assert (first.parent / second).read_bytes() == parts[second]
    assert first.is_relative_to(tmp_path / "hf" / "hub")
    assert {auth for *_, auth in hub.requests} == {"Bearer hf_secret"}
    assert not any("Q8_0" in path for _, path, *_ in hub.requests)


def test_a_cut_download_resumes_where_it_stopped(local_stack: LocalStack, tmp_path: Path) -> None:
    small = tiny_model.ensure("small").read_bytes()  # (larger than huggingface_hub's 10 MB read chunk)
    hub = FakeHub({REPO: {"s-Q4_K_M.gguf": small}}, cut={"s-Q4_K_M.gguf"})
    served = local_stack.serve("hub", hub.app(), ready=None)
    done = fetch(served.url, tmp_path, f"{REPO}/s-Q4_K_M.gguf")
    assert done.returncode == 0, done.stderr
    gets = [rng for method, path, rng, _ in hub.requests if method == "GET" and "/resolve/" in path]
    assert len(gets) == 2 and gets[0] == ""
    resumed_at = int(gets[1].removeprefix("bytes=").rstrip("-"))
    assert 0 < resumed_at < len(small)  # the second asked only for the rest
    assert Path(done.stdout.strip()).read_bytes() == small
    assert "downloading, 100%" in done.stderr


def test_a_corrupted_download_is_refused_and_removed(local_stack: LocalStack, tmp_path: Path,
                                                     tiny: bytes) -> None:
    hub = FakeHub({REPO: {"t-Q4_K_M.gguf": tiny}}, corrupt={"t-Q4_K_M.gguf"})
    served = local_stack.serve("hub", hub.app(), ready=None)
    refused = fetch(served.url, tmp_path, f"{REPO}:Q4_K_M")
    assert refused.returncode == 1
    assert "t-Q4_K_M.gguf has SHA-256 " in refused.stderr and "Traceback" not in refused.stderr
    assert f"the hub says {hashlib.sha256(tiny).hexdigest()}: removed from the cache" in refused.stderr
    assert not list((tmp_path / "hf" / "hub").rglob("*.gguf"))
    assert not [p for p in (tmp_path / "hf" / "hub").rglob("blobs/*") if p.stat().st_size]
    hub.corrupt.clear()  # served right: it downloads again, and is accepted
    assert fetch(served.url, tmp_path, f"{REPO}:Q4_K_M").returncode == 0


def test_offline_the_cached_copy_serves_and_an_unknown_one_is_a_clear_error(
        local_stack: LocalStack, tmp_path: Path, tiny: bytes) -> None:
    hub = FakeHub({REPO: {"t-Q4_K_M.gguf": tiny, "t-Q8_0.gguf": tiny}})
    served = local_stack.serve("hub", hub.app(), ready=None)
    first = fetch(served.url, tmp_path, f"{REPO}:Q4_K_M")
    assert first.returncode == 0, first.stderr
    asked = len(hub.requests)
    again = fetch(served.url, tmp_path, f"{REPO}:Q4_K_M", HF_HUB_OFFLINE="1")
    assert again.returncode == 0, again.stderr
    assert again.stdout == first.stdout and len(hub.requests) == asked  # the hub was not asked
    missing = fetch(served.url, tmp_path, f"{REPO}:Q8_0", HF_HUB_OFFLINE="1")
    assert missing.returncode == 1
    assert "not in the Hugging Face cache, and the hub is not reachable" in missing.stderr
    unknown = fetch(served.url, tmp_path, "macpool/nothing-GGUF:Q4_K_M")
    assert unknown.returncode == 1 and "Traceback" not in unknown.stderr
    assert "macpool/nothing-GGUF:Q4_K_M" in unknown.stderr
