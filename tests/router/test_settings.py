from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from macpool.dev.procs import macpool_argv
from router.auth import KeyRing, load_api_keys
from router.cli import build_settings
from router.settings import ConfigError


def test_flags_beat_env_beat_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "router.toml"
    config.write_text("[router]\nqueue_size = 5\nqueue_timeout = 7.5\nlease-seconds = 9\n")
    monkeypatch.setenv("MACPOOL_QUEUE_TIMEOUT", "3")
    monkeypatch.setenv("MACPOOL_LEASE_SECONDS", "11")
    settings = build_settings(["--config", str(config), "--lease-seconds", "12"])
    assert (settings.queue_size, settings.queue_timeout, settings.lease_seconds) == (5, 3.0, 12.0)


def test_an_on_off_flag_undoes_what_the_file_or_environment_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "router.toml"
    config.write_text("affinity = false\n")
    monkeypatch.setenv("MACPOOL_ACCESS_LOG", "true")
    settings = build_settings(["--config", str(config)])
    assert (settings.affinity, settings.access_log) == (False, True)
    settings = build_settings(["--config", str(config), "--affinity", "--no-access-log"])
    assert (settings.affinity, settings.access_log) == (True, False)


def test_the_api_keys_file_named_in_a_config_file_is_found_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "keys.txt").write_text("sk-one\n")
    (tmp_path / "etc" / "router.toml").write_text('api_keys_file = "keys.txt"\n')
    monkeypatch.chdir(tmp_path)
    settings = build_settings(["--config", "etc/router.toml"])
    assert settings.api_keys_file is not None and settings.api_keys_file.read_text() == "sk-one\n"


def test_bad_value_names_key_and_value() -> None:
    with pytest.raises(ConfigError, match=r"queue_size='-1'"):
        build_settings(["--queue-size", "-1"])


def test_a_redis_url_redis_py_would_misread_is_refused_without_its_password() -> None:
    for url, said in (("redis://h:6379/abc", "database 'abc' is not a number"),
                      ("redis://h:99999/0", "Port out of range"), ("http://h:6379", "expected redis://")):
        with pytest.raises(ConfigError, match=said):
            build_settings(["--redis-url", url])
    with pytest.raises(ConfigError, match=r"redis://user:\*\*\*@h") as raised:
        build_settings(["--redis-url", "redis://user:s3cret@h/db1"])
    assert "s3cret" not in str(raised.value)
    for url in ("redis://h:6379/3", "rediss://user:pw@h:6380", "unix:///tmp/redis.sock?db=2", "redis://h"):
        assert build_settings(["--redis-url", url]).redis_url == url


@pytest.mark.parametrize("url", [
    "redis+sentinel://:data-s3cret@s1/mymaster/x?sentinel_password=sentinel-s3cret",  # a bad database
    "redis+sentinel://s1/mymaster?sentinel_password=sentinel-s3cret&sentinel_username=u&ssl_ca_certs=/ca",
    "redis://user:data-s3cret#sentinel-s3cret@h:6379/0",  # an unencoded "#" cuts the password short
    "rediss+cluster://:data-s3cret@c1:port?ssl_ca_certs=/no/ca.pem",
])
def test_the_error_line_of_a_bad_redis_url_has_no_password(url: str) -> None:
    with pytest.raises(ConfigError, match="invalid redis_url=") as raised:
        build_settings(["--redis-url", url])
    assert "s3cret" not in str(raised.value)


def test_cli_config_error_is_one_line_exit_2(tmp_path: Path) -> None:
    result = subprocess.run(
        macpool_argv("router", "--config", str(tmp_path / "missing.toml")), capture_output=True, timeout=60
    )
    assert result.returncode == 2
    assert result.stderr.decode().strip().count("\n") == 0
    assert b"missing.toml" in result.stderr


def test_api_keys_file_accepts_digests_and_plaintext(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"# clients\nplain-key\n\n{hashlib.sha256(b'hashed-key').hexdigest()}\n")
    ring = KeyRing(load_api_keys(keys))
    assert ring.accepts("plain-key") and ring.accepts("hashed-key")
    assert not ring.accepts("other") and not ring.accepts(None)
    assert KeyRing([]).accepts(None)


def test_api_keys_file_tenant_attributes(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-a name=team-a max_concurrency=3\nsk-b priority=batch\n")
    ring = KeyRing(load_api_keys(keys))
    a, b = ring.match("sk-a"), ring.match("sk-b")
    assert a is not None and (a.tenant, a.priority, a.max_concurrency) == ("team-a", None, 3)
    assert b is not None and b.priority == "batch" and b.max_concurrency is None
    assert b.tenant == "key-" + hashlib.sha256(b"sk-b").hexdigest()[:8]
    assert ring.match("sk-c") is None
    for bad, said in (("sk-x color=red", "unknown attribute"), ("sk-x priority=urgent", "priority="),
                      ("sk-x max_concurrency=0", "max_concurrency="), ("sk-x name=a/b", "name="),
                      ("sk-x name=t\nsk-y name=t", "used twice")):
        keys.write_text(bad + "\n")
        with pytest.raises(ConfigError, match=said):
            load_api_keys(keys)
