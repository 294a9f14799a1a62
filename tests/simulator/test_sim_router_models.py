"""The router-mode simulator's models (macpool/sim/router_models.py): ``--models`` and llama-server's
model-preset INI file (``--models-preset``), the figures each model takes, and what a load of them holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from macpool.sim.cli import UsageError, parse_settings
from macpool.sim.machine import MachineError, load_preset
from macpool.sim.model_files import write_model_gguf
from macpool.sim.router_models import gguf_machine, parse_models, read_models_preset, router_models
from macpool.sim.settings import SimSettings
from tests.conftest import wait_until
from tests.inprocess import LocalStack

MAC = "m4pro-48g-14b-q4"  # 36 GB wired limit, 0.5 GB of buffers, and a start that does not fit fails


def write_ini(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_models_flag_is_checked() -> None:
    assert parse_models("a=p1, b=p2") == {"a": "p1", "b": "p2"}
    for bad in ("a", "=p", "a=p,a=q", ","):
        with pytest.raises(MachineError):
            parse_models(bad)


def test_a_preset_file_is_read_as_llama_server_reads_it(tmp_path: Path) -> None:
    ini = write_ini(tmp_path / "models.ini", """\
version = 1
; every model's settings
[*]
c = 8192
np = 2
temp = 0.5  # not the simulator's: kept, unread

[a]
model = m2pro-32g-8b-q4
parallel = 6

# the global c is overridden by its long name
[b]
model = /models/b.gguf ; inline comment
ctx-size = 16384
""")
    assert read_models_preset(ini) == {
        "a": {"ctx-size": "8192", "parallel": "6", "temp": "0.5", "model": "m2pro-32g-8b-q4"},
        "b": {"ctx-size": "16384", "parallel": "2", "temp": "0.5", "model": "/models/b.gguf"},
    }


def test_each_model_takes_its_figures_slots_and_context(tmp_path: Path) -> None:
    gguf = write_model_gguf(tmp_path / "m.gguf", weights_gb=10, layers=40, kv_heads=8, head_dim=128)
    own = tmp_path / "own.json"
    described = load_preset("m2pro-32g-8b-q4").with_changes(weights_gb=3.0, total_gb=999)
    own.write_text(described.model_dump_json())
    ini = write_ini(tmp_path / "models.ini", f"""\
[*]
parallel = 3
[preset]
model = m2pro-32g-8b-q4
[file]
model = {own}
c = 4096
[gguf]
model = {gguf}
n-parallel = 5
""")
    mac = load_preset(MAC)
    settings = SimSettings(models_preset=ini, ctx_size=32768)
    models = {m.name: m for m in router_models(settings, mac)}
    assert [(m.parallel, m.ctx_size) for m in models.values()] == [(3, 32768), (3, 4096), (5, 32768)]
    assert models["preset"].model == "m2pro-32g-8b-q4" and models["gguf"].model == str(gguf)
    for m in models.values():  # every model on the router's Mac
        assert (m.machine.total_gb, m.machine.wired_limit_gb, m.machine.overcommit) == (48, 36, "fail")
    assert models["preset"].machine.weights_gb == 4.6 and models["file"].machine.weights_gb == 3.0
    # a GGUF: the Mac's own figures, with the file's weights and KV cache, allocated at start
    machine = models["gguf"].machine
    assert machine == gguf_machine(gguf, mac)
    assert machine.weights_gb == pytest.approx(10e9 / 2**30)
    assert machine.kv_mb_per_token == 40 * 8 * 128 * 2 * 2 / 2**20
    assert machine.kv_at_start and machine.model_name == "m.gguf"
    assert machine.decode_t0_ms == mac.decode_t0_ms and machine.base_gb == mac.base_gb


@pytest.mark.parametrize(("section", "message"), [
    ("[a]\nparallel = 2\n", r"\[a\]: no model"),
    ("[a]\nmodel = /nowhere/a.gguf\n", r"\[a\]: no model file '/nowhere/a.gguf'"),
    ("[a]\nmodel = /nowhere/a.json\n", r"\[a\]: cannot read machine file '/nowhere/a.json'"),
    ("[a]\nmodel = no-such-preset\n", r"\[a\]: unknown preset 'no-such-preset'"),
    ("[a]\nmodel = m2pro-32g-8b-q4\nnp = 0\n", r"\[a\]: parallel = '0': not an integer >= 1"),
    ("[a]\nmodel = m2pro-32g-8b-q4\nc = lots\n", r"\[a\]: ctx-size = 'lots': not an integer >= 0"),
    ("version = 1\n[*]\nnp = 4\n", r"no model section"),
    ("[a]\nmodel = m2pro-32g-8b-q4\njust words\n", r"line 3 is not a \[section\]"),
])
def test_a_bad_preset_file_is_named(tmp_path: Path, section: str, message: str) -> None:
    ini = write_ini(tmp_path / "models.ini", section)
    with pytest.raises(MachineError, match=message):
        router_models(SimSettings(models_preset=ini), load_preset(MAC))


def test_a_router_takes_models_from_one_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mac = load_preset(MAC)
    with pytest.raises(MachineError, match="not both"):
        router_models(SimSettings(models="a=m2pro-32g-8b-q4", models_preset=tmp_path / "m.ini"), mac)
    with pytest.raises(MachineError, match="needs --models"):
        router_models(SimSettings(), mac)
    with pytest.raises(MachineError, match="cannot read --models-preset"):
        router_models(SimSettings(models_preset=tmp_path / "missing.ini"), mac)
    with pytest.raises(UsageError, match="not allowed with"):
        parse_settings(["--models", "a=m2pro-32g-8b-q4", "--models-preset", "m.ini"])
    with pytest.raises(UsageError, match="need --models or --models-preset"):
        parse_settings(["--models-max", "2"])
    monkeypatch.setenv("MACPOOL_SIM_MODELS", "a=m2pro-32g-8b-q4")  # the flag wins over the other's variable
    settings, _ = parse_settings(["--models-preset", "m.ini"])
    assert (settings.models, settings.models_preset) == (None, Path("m.ini"))


def memory(url: str) -> dict[str, Any]:
    return dict(httpx.get(url + "/sim/memory", timeout=10).json())


def status_of(url: str, model: str) -> dict[str, Any]:
    listing = httpx.get(url + "/models", timeout=10).json()["data"]
    return dict(next(m["status"] for m in listing if m["id"] == model))


def load_until(url: str, model: str, value: str) -> dict[str, Any]:
    assert httpx.post(url + "/models/load", json={"model": model}, timeout=10).status_code == 200
    wait_until(lambda: status_of(url, model)["value"] == value, 10, f"{model} {value}")
    return status_of(url, model)


@pytest.mark.in_process
def test_a_gguf_model_holds_its_weights_and_its_slots_kv(local_stack: LocalStack, tmp_path: Path) -> None:
    gguf = write_model_gguf(tmp_path / "m.gguf", weights_gb=10, layers=40, kv_heads=8, head_dim=128)
    ini = write_ini(tmp_path / "models.ini", f"version = 1\n[m]\nmodel = {gguf}\nnp = 3\nc = 12288\n")
    url = local_stack.sim("mac", "--preset", MAC, "--speed", "50", "--no-models-autoload",
                          "--models-preset", str(ini)).url
    load_until(url, "m", "loaded")
    kv_gb = 3 * 4096 * (40 * 8 * 128 * 2 * 2 / 2**20) / 1024
    assert memory(url)["models"]["m"]["pinned_gb"] == pytest.approx(10e9 / 2**30 + 0.5 + kv_gb, abs=1e-3)
    props = httpx.get(url + "/props", params={"model": "m"}, timeout=10).json()
    assert props["total_slots"] == 3 and props["default_generation_settings"]["n_ctx"] == 4096
    assert props["model_path"] == str(gguf) and props["model_alias"] == "m"
    args = status_of(url, "m")["args"]
    assert args[args.index("--parallel") + 1] == "3" and args[args.index("--ctx-size") + 1] == "12288"


@pytest.mark.in_process
def test_two_large_models_do_not_both_fit(local_stack: LocalStack, tmp_path: Path) -> None:
    # two 20 GB models with 4 slots of 8K (6 GB of KV each): one fits under the 36 GB wired limit, not two
    a = write_model_gguf(tmp_path / "a.gguf", weights_gb=20, layers=48)
    b = write_model_gguf(tmp_path / "b.gguf", weights_gb=20, layers=48)
    ini = write_ini(tmp_path / "models.ini", f"[*]\nparallel = 4\nctx-size = 32768\n"
                                             f"[a]\nmodel = {a}\n[b]\nmodel = {b}\n")
    url = local_stack.sim("mac", "--preset", MAC, "--speed", "50", "--no-models-autoload",
                          "--models-max", "0", "--models-preset", str(ini)).url
    load_until(url, "a", "loaded")
    held_a = memory(url)["models"]["a"]["pinned_gb"]
    assert held_a == pytest.approx(20e9 / 2**30 + 0.5 + 6.0, abs=1e-3)
    failed = load_until(url, "b", "unloaded")
    assert failed["failed"] is True and failed["exit_code"] == 1
    assert memory(url)["pinned_gb"] == pytest.approx(held_a)
