"""A command's settings model is its command line: flags > MACPOOL_* environment > --config file > defaults,
every flag with its help, default and variable, one line for a bad value (never a secret's)."""

from __future__ import annotations

from pathlib import Path
from typing import Self

import pytest
from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from macpool.settings import CommandSettings, ConfigError, UserPath


class Example(CommandSettings):
    """Run the example."""

    model_config = SettingsConfigDict(cli_prog_name="macpool example")
    config_table = "example"

    port: int = Field(default=8080, ge=0, le=65535, description="port to listen on")
    queue_size: int = Field(default=64, ge=0, description="bound of the wait queue")
    lease_seconds: float = Field(default=30.0, gt=0, description="reservation lease")
    keys_file: UserPath | None = Field(default=None, description="client API keys")
    affinity: bool = Field(default=True, description="prefer the node holding the prompt's prefix")
    access_log: bool = Field(default=False, description="log every request")
    agent_token: str | None = Field(default=None, description="token sent to the agents")
    redis_url: str = Field(default="redis://127.0.0.1:6379/0", description="the pool's Redis")
    low: float = Field(default=0.5, description="scale down under this")
    high: float = Field(default=0.8, description="scale up over this")

    @model_validator(mode="after")
    def _band(self) -> Self:
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) is over high ({self.high})")
        return self


def test_flags_beat_environment_beat_file_beat_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "example.toml"
    config.write_text("[example]\nport = 1\nqueue-size = 2\nlease_seconds = 3\n")
    monkeypatch.setenv("MACPOOL_QUEUE_SIZE", "20")
    monkeypatch.setenv("MACPOOL_LEASE_SECONDS", "30")
    settings = Example.from_argv(["--config", str(config), "--lease-seconds", "300"])
    assert (settings.port, settings.queue_size, settings.lease_seconds) == (1, 20, 300.0)
    assert (settings.access_log, Example.from_argv([]).port) == (False, 8080)


def test_the_file_is_a_table_or_top_level_keys_named_by_a_flag_or_a_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "example.toml"
    config.write_text("port = 1\n")
    assert Example.from_argv(["--config", str(config)]).port == 1
    config.write_text("port = 1\n[example]\nport = 3\n[other]\nport = 4\n")
    monkeypatch.setenv("MACPOOL_CONFIG", str(config))
    assert Example.from_argv([]).port == 3
    assert Example(config=config).port == 3  # from code too


def test_relative_paths_in_the_file_are_the_files_and_tilde_is_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for folder in ("etc", "home"):
        (tmp_path / folder).mkdir()
    (tmp_path / "etc" / "example.toml").write_text('keys_file = "keys.txt"\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert Example.from_argv(["--config", "etc/example.toml"]).keys_file == Path("etc/keys.txt")
    # given as a flag, a relative path is the working directory's, as on any command line
    assert Example.from_argv(["--config", "etc/example.toml", "--keys-file", "k"]).keys_file == Path("k")
    (tmp_path / "etc" / "example.toml").write_text('keys_file = "~/keys.txt"\n')
    settings = Example.from_argv(["--config", "~/../etc/example.toml"])
    assert settings.keys_file == tmp_path / "home" / "keys.txt"


def test_a_switch_is_a_flag_both_ways_that_undoes_the_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "example.toml"
    config.write_text("affinity = false\n")
    monkeypatch.setenv("MACPOOL_ACCESS_LOG", "true")
    settings = Example.from_argv(["--config", str(config)])
    assert (settings.affinity, settings.access_log) == (False, True)
    settings = Example.from_argv(["--config", str(config), "--affinity", "--no-access-log"])
    assert (settings.affinity, settings.access_log) == (True, False)


@pytest.mark.parametrize(("argv", "said"), [
    (["--port", "x"], "invalid port='x': Input should be a valid integer"),
    (["--queue-size", "-1"], "invalid queue_size='-1': Input should be greater than or equal to 0"),
    (["--low", "0.9"], "low (0.9) is over high (0.8)"),
])
def test_a_bad_value_is_one_line_naming_the_key_and_the_value(argv: list[str], said: str) -> None:
    with pytest.raises(ConfigError) as raised:
        Example.from_argv(argv)
    assert str(raised.value).startswith(said) and "\n" not in str(raised.value)


def test_a_secret_is_never_shown(tmp_path: Path) -> None:
    config = tmp_path / "example.toml"
    config.write_text('agent_token = ["s3cret"]\n')
    with pytest.raises(ConfigError, match=r"agent_token=\*\*\*") as raised:
        Example.from_argv(["--config", str(config)])
    config.write_text('redis_url = ["redis://user:s3cret@host/0"]\n')
    with pytest.raises(ConfigError, match=r"redis_url=") as unshown:
        Example.from_argv(["--config", str(config)])
    assert "s3cret" not in str(raised.value) + str(unshown.value)
    assert "redis://user:***@host/0" in str(unshown.value)


@pytest.mark.parametrize(("content", "said"), [
    (None, "no such file"),
    ("port = ", "example.toml'.*Invalid value"),
    (b"\xff\xfe", "not UTF-8"),
    ("[example]\nportt = 1\n", "unknown setting 'portt'"),
    ("example = 1\n", r"\[example\] must be a table"),
    ('config = "other.toml"\n', "cannot name another"),
])
def test_a_config_file_that_cannot_work_is_one_line_naming_it(
    tmp_path: Path, content: str | bytes | None, said: str
) -> None:
    config = tmp_path / "example.toml"
    if isinstance(content, bytes):
        config.write_bytes(content)
    elif content is not None:
        config.write_text(content)
    with pytest.raises(ConfigError, match=said) as raised:
        Example.from_argv(["--config", str(config)])
    assert "\n" not in str(raised.value)


def test_help_lists_every_setting_with_its_help_default_and_variable(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        Example.from_argv(["--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert text.startswith("usage: macpool example") and "Run the example." in text
    for name, field in Example.model_fields.items():
        flag = "--" + name.replace("_", "-")
        assert f"{flag} " in text and f"[env: MACPOOL_{name.upper()}]" in text, name
        assert " ".join(str(field.description).split()) in text, name
    assert "--affinity, --no-affinity prefer the node holding the prompt's prefix (default: True)" in text
    assert "--keys-file Path client API keys (default: unset)" in text


def test_an_unknown_flag_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        Example.from_argv(["--prot", "80"])
    assert exited.value.code == 2
    assert "unrecognized arguments: --prot 80" in capsys.readouterr().err
