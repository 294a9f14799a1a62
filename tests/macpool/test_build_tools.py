"""Where the test command finds its tools: cmake and ninja from the venv, the system's compiler, the
installed browser; and the one line that says what to install when one is missing.

macOS is played by ``platform.system()`` and a stand-in ``xcode-select`` on PATH: this checks the lookup
and the messages, not a build on a Mac.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from macpool.dev import cli as dev
from macpool.dev import llama_build

Tools = Callable[..., Path]


@pytest.fixture
def tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Tools:
    """Put stand-in executables into a folder: ``tools("system", "cmake", "c++")``; the folder ``venv``
    is this interpreter's bin directory, ``system`` is the whole PATH."""
    venv, system = tmp_path / "venv" / "bin", tmp_path / "system"
    venv.mkdir(parents=True)
    system.mkdir()
    monkeypatch.setattr(sys, "executable", str(venv / "python"))
    monkeypatch.setenv("PATH", str(system))
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(platform, "system", lambda: "Linux")

    def put(folder: str, *names: str, exit_code: int = 0) -> Path:
        where = {"venv": venv, "system": system}[folder]
        for name in names:
            path = where / name
            path.write_text(f"#!/bin/sh\nexit {exit_code}\n")
            path.chmod(0o755)
        return where

    return put


def test_cmake_and_ninja_are_taken_from_the_venv_first(tools: Tools) -> None:
    venv = tools("venv", "cmake", "ninja")
    tools("system", "cmake", "ninja", "c++")
    assert llama_build.build_tools() == {"cmake": str(venv / "cmake"), "ninja": str(venv / "ninja")}


def test_system_cmake_and_ninja_do_too(tools: Tools) -> None:
    system = tools("system", "cmake", "ninja", "g++")
    assert llama_build.build_tools() == {"cmake": str(system / "cmake"), "ninja": str(system / "ninja")}
    assert llama_build.find_compiler() == str(system / "g++")


@pytest.mark.parametrize("tool", ["cmake", "ninja"])
def test_a_missing_build_tool_says_pip_install(tools: Tools, tool: str) -> None:
    tools("venv", *({"cmake", "ninja"} - {tool}))
    tools("system", "c++")
    with pytest.raises(llama_build.BuildError) as error:
        llama_build.build_tools()
    assert str(error.value) == f"{tool} not found: pip install {tool} (the test extra has it)"


def test_cxx_is_the_compiler_when_set(tools: Tools, monkeypatch: pytest.MonkeyPatch) -> None:
    system = tools("system", "c++", "clang++")
    monkeypatch.setenv("CXX", "clang++ -stdlib=libc++")
    assert llama_build.find_compiler() == str(system / "clang++")
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert llama_build.find_compiler() is None


def test_no_compiler_on_debian_says_apt_get(tools: Tools) -> None:
    tools("venv", "cmake", "ninja")
    with pytest.raises(llama_build.BuildError) as error:
        llama_build.build_tools()
    assert str(error.value) == (
        "no C++ compiler (c++, g++, clang++) found: install g++ or clang++ with the system's package manager"
    )
    tools("system", "apt-get")
    with pytest.raises(llama_build.BuildError, match=r"found: apt-get install g\+\+$"):
        llama_build.build_tools()


def test_macos_without_command_line_tools_says_xcode_select(
    tools: Tools, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    tools("venv", "cmake", "ninja")
    tools("system", "c++", "clang++")  # macOS has /usr/bin/c++ before the tools are installed
    tools("system", "xcode-select", exit_code=2)  # `xcode-select -p`: no developer directory
    with pytest.raises(llama_build.BuildError) as error:
        llama_build.build_tools()
    assert str(error.value).endswith("found: install Xcode's command line tools: xcode-select --install")
    system = tools("system", "xcode-select")
    assert llama_build.find_compiler() == str(system / "c++")


@pytest.mark.parametrize("system", ["Linux", "Darwin"])
def test_cmake_flags(system: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "system", lambda: system)
    found = {"cmake": "/venv/bin/cmake", "ninja": "/venv/bin/ninja"}
    args = llama_build._cmake_args(tmp_path / "src", tmp_path / "build", found)
    assert args[0] == "/venv/bin/cmake" and "-DCMAKE_MAKE_PROGRAM=/venv/bin/ninja" in args
    for flag in (
        "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DBUILD_SHARED_LIBS=OFF",
        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    ):
        assert flag in args
    assert args[args.index("-G") + 1] == "Ninja"
    metal = [arg for arg in args if "METAL" in arg]
    assert metal == (["-DGGML_METAL=OFF"] if system == "Linux" else ["-DGGML_METAL_EMBED_LIBRARY=ON"])


def test_debian_root_apt_gets_only_the_compiler(
    tools: Tools, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MACPOOL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MACPOOL_LLAMA_SERVER_BIN", raising=False)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    calls: list[list[str]] = []

    def call(argv: list[str], **kwargs: object) -> int:  # records apt-get instead of running it
        calls.append(argv)
        return 0

    monkeypatch.setattr(subprocess, "call", call)
    tools("system", "apt-get")
    dev._ensure_build_tools()
    assert calls[-1][-1] == "g++" and "install" in calls[-1]
    calls.clear()
    tools("system", "g++")
    dev._ensure_build_tools()
    assert calls == []


def test_the_installed_browser_is_found(
    tools: Tools, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dev, "APP_FOLDERS", (tmp_path / "Applications",))
    assert dev.find_browser() is None
    app = tmp_path / "Applications" / "Google Chrome.app" / "Contents" / "MacOS" / "Google Chrome"
    app.parent.mkdir(parents=True)
    app.write_text("")
    assert dev.find_browser() == app
    system = tools("system", "google-chrome")
    assert dev.find_browser() == system / "google-chrome"
    tools("system", "chromium-browser")
    assert dev.find_browser() == system / "chromium-browser"


def test_a_missing_browser_says_what_to_install(tools: Tools, monkeypatch: pytest.MonkeyPatch) -> None:
    looked = "no Chromium or Chrome found (chromium, chromium-browser, google-chrome, google-chrome-stable, "
    assert dev.browser_missing() == looked + "or in /Applications): install Chromium or Google Chrome"
    tools("system", "apt-get")
    assert dev.browser_missing().endswith("): apt-get install chromium")
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    mac = "): install Google Chrome, or Chromium (brew install --cask chromium)"
    assert dev.browser_missing().endswith(mac)
