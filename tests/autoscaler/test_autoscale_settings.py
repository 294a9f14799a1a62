"""`macpool autoscale`'s settings: the scaling policy's knobs (declared once, macpool/scaling.py) under the
autoscaler's names, the router's scale hint reading the same knobs under its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from macpool.autoscale.settings import AutoscaleSettings
from macpool.scaling import ScalePolicy
from macpool.settings import ConfigError
from router.settings import Settings as RouterSettings


def test_the_knobs_are_flags_variables_and_keys_of_the_autoscaler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "pool.toml"
    config.write_text("[autoscale]\nmax_nodes = 9\ncooldown = 7\n[router]\nscale_max_nodes = 3\n")
    monkeypatch.setenv("MACPOOL_DOWN_DELAY", "45")
    monkeypatch.setenv("MACPOOL_SCALE_UP_DELAY", "99")  # the router's: not the autoscaler's
    settings = AutoscaleSettings.from_argv(["--config", str(config), "--target-utilisation", "0.7"])
    controller = settings.controller()
    assert controller.policy == ScalePolicy(target_utilisation=0.7, down_delay=45, max_nodes=9)
    assert (controller.cooldown_s, controller.lease_s) == (7.0, 5.0)
    router = RouterSettings.from_argv(["--config", str(config), "--scale-target-utilisation", "0.6"])
    assert router.policy() == ScalePolicy(target_utilisation=0.6, up_delay=99, max_nodes=3, min_nodes=1)


@pytest.mark.parametrize(("argv", "said"), [
    (["--low-utilisation", "0.9"], "low_utilisation (0.9) is over target_utilisation (0.8)"),
    (["--min-nodes", "5", "--max-nodes", "4"], "min_nodes (5) is over max_nodes (4)"),
    (["--target-utilisation", "1.5"], "invalid target_utilisation='1.5': Input should be less than or equal"),
    (["--lease", "1"], "lease (1.0) must be longer than interval (1.0)"),
])
def test_a_policy_that_cannot_work_is_refused_naming_the_autoscalers_keys(argv: list[str], said: str) -> None:
    with pytest.raises(ConfigError) as raised:
        AutoscaleSettings.from_argv(argv)
    assert str(raised.value).startswith(said)


def test_the_router_names_the_same_rules_with_its_keys() -> None:
    with pytest.raises(ConfigError, match=r"^scale_low_utilisation \(0.9\) is over scale_target_utilisation"):
        RouterSettings.from_argv(["--scale-low-utilisation", "0.9"])
    with pytest.raises(ConfigError, match=r"^invalid scale_max_nodes='0'"):
        RouterSettings.from_argv(["--scale-max-nodes", "0"])
    # at most the target: a band of one figure still has the delays, and the autoscaler's one node less
    assert RouterSettings.from_argv(["--scale-low-utilisation", "0.8"]).policy().low_utilisation == 0.8
    assert AutoscaleSettings.from_argv(["--low-utilisation", "0.8"]).low_utilisation == 0.8
