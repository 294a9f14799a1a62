"""Settings: flags > MACPOOL_* environment > TOML file; the calibration file feeds the calibrated cap."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from macpool.settings import ConfigError
from node_agent.calibrate import Knee, write_config
from node_agent.cli import build_settings
from node_agent.settings import AgentSettings

ATTACH = ["--upstream", "http://127.0.0.1:1"]


def test_flags_beat_environment_beat_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "agent.toml"
    config.write_text(
        'upstream = "http://file:1"\nnode_id = "from-file"\ncap = 3\nheadroom_gb = 4.0\n'
        'redis_url = "redis://file:6379/0"\n'
    )
    monkeypatch.setenv("MACPOOL_NODE_ID", "from-env")
    monkeypatch.setenv("MACPOOL_CAP", "5")
    monkeypatch.setenv("MACPOOL_AGENT_TOKEN", "env-token-of-16-chars")
    settings = build_settings(["--config", str(config), "--cap", "7"])
    assert settings.cap == 7  # flag
    assert settings.node_id == "from-env"  # env over file
    assert settings.headroom_gb == 4.0 and settings.upstream == "http://file:1"  # file
    assert settings.token == "env-token-of-16-chars"
    flagged = build_settings(["--config", str(config), "--token", "flag-token-of-16-chars"])
    assert flagged.token == "flag-token-of-16-chars"


def test_the_token_goes_by_its_names_and_the_routers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "agent.toml"
    for key in ("token", "agent_token"):
        config.write_text(f'upstream = "http://file:1"\n{key} = "from-file-token-16"\n')
        assert build_settings(["--config", str(config)]).token == "from-file-token-16"
    for flag in ("--token", "--agent-token"):
        assert build_settings([*ATTACH, flag, "from-flag-token-16"]).token == "from-flag-token-16"
    monkeypatch.setenv("MACPOOL_TOKEN", "agents-own-token-16")
    assert build_settings(ATTACH).token == "agents-own-token-16"
    # named as the router names it: it wins
    monkeypatch.setenv("MACPOOL_AGENT_TOKEN", "the-routers-token-16")
    assert build_settings(ATTACH).token == "the-routers-token-16"


def test_the_mode_flag_wins_over_the_other_mode_from_the_file_or_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--upstream and --llama-server are one choice: a flag naming one beats the other's key or variable."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    config = tmp_path / "agent.toml"
    config.write_text(f'llama_server = "true"\nmodel = "{model}"\n')
    settings = build_settings(["--config", str(config), *ATTACH])
    assert (settings.upstream, settings.supervise) == ("http://127.0.0.1:1", False)
    monkeypatch.setenv("MACPOOL_UPSTREAM", "http://127.0.0.1:1")
    settings = build_settings(["--llama-server", "true", "--model", str(model)])
    assert (settings.upstream, settings.llama_command) == (None, ["true"])
    with pytest.raises(ConfigError, match="exactly one"):
        build_settings(["--config", str(config)])


def test_a_config_files_paths_are_relative_to_it_and_tilde_is_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home, etc, elsewhere = tmp_path / "home", tmp_path / "etc", tmp_path / "elsewhere"
    for directory in (home, etc, elsewhere):
        directory.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(elsewhere)  # launchd starts the agent in /, not beside its file
    binary = home / "llama.cpp" / "llama-server"
    binary.parent.mkdir()
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    (home / "models").mkdir()
    (home / "models" / "m.gguf").write_bytes(b"GGUF")
    config = etc / "agent.toml"
    config.write_text('llama_server = "~/llama.cpp/llama-server"\nmodel = "~/models/m.gguf"\n'
                      'llama_log = "logs/llama-server.log"\n')
    settings = build_settings(["--config", str(config)])
    assert settings.llama_server == str(home / "llama.cpp" / "llama-server")
    assert settings.model_file == home / "models" / "m.gguf"
    assert settings.llama_log == etc / "logs" / "llama-server.log"
    # given as a flag, a relative path is the working directory's, as on any command line
    assert build_settings(["--config", str(config), "--llama-log", "x.log"]).llama_log == Path("x.log")


def test_calibration_file_sets_the_calibrated_terms_but_a_flag_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = tmp_path / "cal.json"
    result.write_text(json.dumps({"recommended_cap": 8, "per_request_gb": 2.6, "rows": []}))
    monkeypatch.setenv("MACPOOL_CALIBRATED_CAP", "3")  # the calibration file's figure beats it
    settings = build_settings([*ATTACH, "--calibration", str(result)])
    assert (settings.calibrated_cap, settings.calibrated_per_request_gb) == (8, 2.6)
    settings = build_settings([*ATTACH, "--calibration", str(result), "--calibrated-cap", "5"])
    assert (settings.calibrated_cap, settings.calibrated_per_request_gb) == (5, 2.6)
    written = tmp_path / "agent.toml"
    written.write_text("calibrated_cap = 6\n")
    assert build_settings([*ATTACH, "--calibration", str(written)]).calibrated_cap == 6


@pytest.mark.parametrize("layout", ["top-level", "agent table", "dotted keys"])
def test_write_config_puts_the_cap_where_the_agent_reads_it(tmp_path: Path, layout: str) -> None:
    config = tmp_path / "agent.toml"
    keys = 'upstream = "http://127.0.0.1:1"\ncalibrated_cap = 2\n'
    agent_table = f'# the agent\n[agent]  # this node\n{keys}\n[router]\n'
    dotted = 'agent.upstream = "http://127.0.0.1:1"\nagent.calibrated_cap = 2\n'
    config.write_text({"top-level": keys, "agent table": agent_table, "dotted keys": dotted}[layout])
    for cap in (7, 5):  # written twice: the second replaces the first
        write_config(config, Knee(cap, "memory", 2.5, 20.0, 96.0))
        settings = build_settings(["--config", str(config)])
        assert (settings.calibrated_cap, settings.calibrated_per_request_gb) == (cap, 2.5)
        calibrated = build_settings([*ATTACH, "--calibration", str(config)])
        assert calibrated.calibrated_cap == cap
    assert config.read_text().count("calibrated_cap") == 1


def test_calibration_values_are_checked_like_any_setting(tmp_path: Path) -> None:
    """A bad figure in a calibration file stops the agent at start with one line, rather than failing every
    heartbeat with a traceback."""
    negative = ('{"recommended_cap": 4, "per_request_gb": -0.001}', "calibrated_per_request_gb=-0.001")
    for content, said in (('{"recommended_cap": "x"}', "calibrated_cap='x'"),
                          ('{"recommended_cap": -5}', "calibrated_cap=-5"), negative):
        path = tmp_path / "cal.json"
        path.write_text(content)
        with pytest.raises(ConfigError, match=said):
            build_settings([*ATTACH, "--calibration", str(path)])
    binary = tmp_path / "cal.toml"
    binary.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="not UTF-8"):
        build_settings([*ATTACH, "--calibration", str(binary)])
    with pytest.raises(ConfigError, match="not UTF-8"):
        build_settings([*ATTACH, "--config", str(binary)])


def test_setting_errors_are_one_line_and_never_echo_a_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MACPOOL_LLAMA_ARGS", "--x")  # a list setting takes JSON
    with pytest.raises(ConfigError, match="JSON"):
        build_settings(ATTACH)
    monkeypatch.delenv("MACPOOL_LLAMA_ARGS")
    config = tmp_path / "agent.toml"
    config.write_text('upstream = "http://127.0.0.1:1"\nagent_tokn = "s3cret"\n')
    with pytest.raises(ConfigError, match="unknown setting 'agent_tokn'") as raised:
        build_settings(["--config", str(config)])
    assert "s3cret" not in str(raised.value)
    config.write_text('upstream = "http://127.0.0.1:1"\ntoken = ["not", "a", "string"]\n')
    with pytest.raises(ConfigError, match=r"token=\*\*\*") as raised:
        build_settings(["--config", str(config)])
    assert "not" not in str(raised.value).replace("not a valid", "")


def test_one_line_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="parallel='0'"):
        build_settings([*ATTACH, "--parallel", "0"])
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ConfigError, match="recommended_cap"):
        build_settings([*ATTACH, "--calibration", str(bad)])


@pytest.mark.parametrize(("argv", "message"), [
    (["--upstream", "ftp://h:1"], "upstream='ftp://h:1': expected http://host:port"),
    (["--upstream", "http://h:99999"], "upstream='http://h:99999': Port out of range"),
    ([*ATTACH, "--advertise-url", "h:1"], "advertise_url='h:1': expected http://host:port"),
    (["--llama-server", "no-such-llama", "-m", "a.gguf"], "'no-such-llama': no such executable"),
    (["--llama-server", " ", "-m", "a.gguf"], "llama_server=' ': empty"),
    (["--llama-server", "true"],
     "--model FILE.gguf|org/repo:QUANT (or --models NAME=SOURCE,..., or --from-pool) is required"),
    (["--llama-server", "true", "-m", "missing.gguf"], "model='missing.gguf': no such file"),
    ([*ATTACH, "--calibration", "missing.json"], "calibration='missing.json': no such file"),
    ([*ATTACH, "--node-id", "a b"], "node_id='a b': String should match pattern"),
])
def test_a_setting_that_cannot_work_is_one_line_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str], message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    with pytest.raises(ConfigError) as raised:
        build_settings(argv)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_the_arguments_after_the_double_dash_are_llama_servers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    monkeypatch.setenv("MACPOOL_LLAMA_ARGS", '["--from-env"]')
    supervise = ["--llama-server", "true", "-m", "a.gguf"]
    settings = build_settings([*supervise, "--", "--tensor-split", "3,1", "-ngl", "99", "--", "x"])
    assert settings.llama_args == ["--tensor-split", "3,1", "-ngl", "99", "--", "x"]
    assert build_settings(supervise).llama_args == ["--from-env"]
    with pytest.raises(ConfigError, match=r"-- --port=9: the agent runs llama-server on 127\.0\.0\.1"):
        build_settings([*supervise, "--", "--port=9"])
    # attached, they describe how its llama-server was started: its own --port included
    assert build_settings([*ATTACH, "--", "--port", "9"]).llama_args == ["--port", "9"]


def test_a_misspelled_file_key_fails_but_other_programs_environment_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "agent.toml"
    config.write_text('[agent]\nupstream = "http://127.0.0.1:1"\nheartbeat-intervall = 9\n')
    with pytest.raises(ConfigError, match="heartbeat_intervall"):
        build_settings(["--config", str(config)])
    monkeypatch.setenv("MACPOOL_QUEUE_SIZE", "3")  # the router's, in a shared environment
    config.write_text('[agent]\nupstream = "http://127.0.0.1:1"\nheartbeat-interval = 2\n')
    assert build_settings(["--config", str(config)]).heartbeat_interval == 2.0


def test_several_models_from_a_flag_the_environment_or_a_table_relative_to_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("a", "b"):
        (tmp_path / f"{name}.gguf").write_bytes(b"GGUF")
    config = tmp_path / "agent.toml"
    config.write_text('llama_server = "true"\n[models]\nchat = "a.gguf"\ncoder = "b.gguf"\n')
    monkeypatch.chdir("/")
    settings = build_settings(["--config", str(config)])
    assert settings.model_files == {"chat": tmp_path / "a.gguf", "coder": tmp_path / "b.gguf"}
    flag = f"chat={tmp_path / 'a.gguf'}, coder={tmp_path / 'b.gguf'}"
    assert list(build_settings(["--llama-server", "true", "--models", flag]).models) == ["chat", "coder"]
    monkeypatch.setenv("MACPOOL_MODELS", f"only={tmp_path / 'a.gguf'}")
    assert list(build_settings(["--llama-server", "true"]).models) == ["only"]


@pytest.mark.parametrize(("flags", "message"), [
    (["--models", "chat"], "NAME=FILE"),
    (["--models", "a=x.gguf,a=y.gguf"], "twice"),
    (["--models", "bad/name=a.gguf"], "not a model name"),
    (["--models", "chat=missing.gguf"], "no such file"),
    (["--models", "chat=a.gguf", "--model", "a.gguf"], "not both"),
    (["--models", "chat=a.gguf", *ATTACH], "needs --llama-server"),
])
def test_bad_model_lists_fail_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: list[str], message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    argv = flags if "--upstream" in flags else ["--llama-server", "true", *flags]
    with pytest.raises(ConfigError, match=message):
        build_settings(argv)


def test_the_light_cap_is_a_flag_a_variable_or_a_key_and_at_least_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "agent.toml"
    config.write_text('upstream = "http://file:1"\nlight_cap = 3\n')
    assert build_settings(["--config", str(config)]).light_cap == 3
    monkeypatch.setenv("MACPOOL_LIGHT_CAP", "5")
    assert build_settings(["--config", str(config)]).light_cap == 5
    assert build_settings(["--light-cap", "7", "--config", str(config)]).light_cap == 7
    monkeypatch.delenv("MACPOOL_LIGHT_CAP")
    assert build_settings(ATTACH).light_cap == 8
    with pytest.raises(ConfigError, match="light_cap"):
        build_settings([*ATTACH, "--light-cap", "0"])


def test_settings_built_in_code_are_checked_as_the_command_lines_are(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        AgentSettings()
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    assert AgentSettings(llama_server="true", model=model).supervise


def test_a_model_may_be_a_hugging_face_reference_on_the_command_line_or_in_a_file(tmp_path: Path) -> None:
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    settings = build_settings(["--llama-server", "true", "-m", "Qwen/Qwen3-8B-GGUF:Q4_K_M"])
    assert settings.model == "Qwen/Qwen3-8B-GGUF:Q4_K_M"
    config = tmp_path / "agent.toml"
    config.write_text('llama_server = "true"\n[models]\nchat = "org/chat-GGUF/chat-Q8_0.gguf"\n'
                      'local = "a.gguf"\n')
    from_file = build_settings(["--config", str(config)])
    # the reference as it is; the file relative to the config file
    assert from_file.models == {"chat": "org/chat-GGUF/chat-Q8_0.gguf", "local": str(tmp_path / "a.gguf")}
    with pytest.raises(RuntimeError, match="not downloaded"):
        _ = from_file.model_files
    assert build_settings(["--llama-server", "true", "--from-pool"]).multi_model
