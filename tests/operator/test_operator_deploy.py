"""The deploy files and the guides say only true things: real subcommands, flags and MACPOOL_* settings,
consistent ports, paths and grace periods, queries (alerts, Grafana, KEDA, HPA) over metrics and labels the
router and the agent really export, a balancer configured for streams and 503s."""

from __future__ import annotations

import argparse
import json
import plistlib
import re
import shutil
import subprocess
import tomllib
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase
from pydantic.fields import FieldInfo
from pydantic_settings import CliSettingsSource

from macpool.autoscale.settings import AutoscaleSettings
from macpool.dev.procs import macpool_argv
from macpool.sim.machine import preset_names
from node_agent.runtime import AgentMetrics
from node_agent.settings import AgentSettings
from router.metrics import RouterMetrics
from router.settings import Settings as RouterSettings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
# `sum by (x, y) (rate(macpool_thing[5m]))`: the labels kept, and the metric they come from
GROUPED = re.compile(r"\bby\s*\(([^)]*)\)\s*\((?:\s*\w+\s*\()*\s*(macpool_[a-z0-9_]+)")
METRIC = re.compile(r"\bmacpool_[a-z0-9_]+")
FLAG = re.compile(r"^--[a-z][a-z0-9-]*")


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def macpool_services() -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in compose()["services"].items() if svc.get("image") == "macpool:latest"}


@cache
def help_text(*subcommand: str) -> str:
    result = subprocess.run(macpool_argv(*subcommand, "--help"), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"macpool {' '.join(subcommand)} --help failed: {result.stderr}"
    return result.stdout


def unknown_flags(subcommand: tuple[str, ...], args: list[str]) -> list[str]:
    """The flags among ``args`` that ``macpool <subcommand> --help`` does not list."""
    text = help_text(*subcommand)
    if subcommand == ("agent", "join"):  # the options join does not know are `agent run`'s
        text += help_text("agent", "run")
    flags = [m.group() for m in map(FLAG.match, (arg.lstrip("[(") for arg in args)) if m]  # "[--port 8080]"
    return [flag for flag in flags if not re.search(rf"(^|\s|,){re.escape(flag)}\b", text)]


def split_command(command: list[str]) -> tuple[tuple[str, ...], list[str]]:
    words = 2 if command[:2] == ["agent", "run"] else 1
    return tuple(command[:words]), command[words:]


def flag_value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def env_names(settings_cls: type[Any]) -> set[str]:
    """The MACPOOL_* variables a settings model reads, as pydantic-settings resolves them for --help."""
    source = CliSettingsSource(settings_cls, cli_show_env_vars=True)
    return {name for names in source.env_var_names.values() for name in names}


def test_every_compose_service_runs_a_real_subcommand_with_real_flags() -> None:
    services = macpool_services()
    assert {"router", "agent-1", "agent-2", "agent-3", "sim-1", "sim-2", "sim-3"} <= set(services)
    for name, svc in services.items():
        subcommand, args = split_command(svc["command"])
        assert subcommand[0] in ("router", "agent", "sim"), name
        assert not unknown_flags(subcommand, args), name


def test_compose_ports_env_and_urls_agree() -> None:
    services = compose()["services"]
    ours = macpool_services()
    router_env, agent_env = env_names(RouterSettings), env_names(AgentSettings)
    listen: dict[str, int] = {}
    for name, svc in ours.items():
        subcommand, args = split_command(svc["command"])
        port = int(flag_value(args, "--port"))
        listen[name] = port
        published = [str(p).rsplit(":", 1)[-1] for p in svc.get("ports", [])]
        exposed = [str(p) for p in svc.get("expose", [])] + published
        assert str(port) in exposed, f"{name}: port {port} not exposed"
        assert flag_value(args, "--host") == "0.0.0.0", f"{name} must listen beyond loopback in a container"
        known = router_env if subcommand[0] == "router" else agent_env
        for key in svc.get("environment", {}):
            assert key in known, f"{name}: {key} is no setting of macpool {subcommand[0]}"
        redis = svc.get("environment", {}).get("MACPOOL_REDIS_URL")
        if subcommand[0] in ("router", "agent"):
            assert urlparse(redis).hostname in services, f"{name}: redis host unknown"
    tokens = {svc["environment"]["MACPOOL_AGENT_TOKEN"] for svc in ours.values() if "environment" in svc}
    assert len(tokens) == 1, "the router and every agent must share one agent token"
    for name, svc in ours.items():
        _, args = split_command(svc["command"])
        for flag in ("--upstream", "--advertise-url"):
            if flag in args:
                url = urlparse(flag_value(args, flag))
                assert url.hostname in listen and url.port == listen[url.hostname], f"{name}: {flag} {url}"
        if "--advertise-url" in args:
            assert urlparse(flag_value(args, "--advertise-url")).hostname == name
        if "--preset" in args:
            assert flag_value(args, "--preset") in preset_names(), f"{name}: no such simulator preset"
    prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.compose.yml").read_text())
    for job in prometheus["scrape_configs"]:
        for target in job["static_configs"][0]["targets"]:
            host, port = target.rsplit(":", 1)
            assert listen.get(host) == int(port), f"prometheus target {target} matches no service"


@pytest.fixture
def exported_metrics(redis_url: str, spawn: Callable[..., Any]) -> set[str]:
    """Every sample name a real router's or agent's /metrics can carry (from their # TYPE lines)."""
    router = spawn("router", "--redis-url", redis_url, name="router")
    sim = spawn("sim", "--preset", sorted(preset_names())[0], "--metrics", name="sim", timeout=60)
    agent = spawn("agent", "run", "--upstream", sim.url, "--redis-url", redis_url, name="agent", timeout=60)
    names: set[str] = set()
    for server in (router, agent):
        for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split()
                names.add(name)
                if kind == "histogram":
                    names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
                if kind == "counter" and not name.endswith("_total"):
                    names.add(f"{name}_total")
    assert {"macpool_pool_saturation", "macpool_agent_state_info"} <= names
    return names


SAMPLE_SUFFIXES = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}


def declared_labels() -> dict[str, set[str]]:
    """Sample name -> the label names the code gives it (router/metrics.py, node_agent/runtime.py)."""
    labels: dict[str, set[str]] = {}
    for metrics in (RouterMetrics(), AgentMetrics()):
        for collector in vars(metrics).values():
            if not isinstance(collector, MetricWrapperBase):
                continue
            names = set(collector._labelnames)
            for family in collector.describe():
                if family.type == "histogram":  # named as a whole too, as `macpool_ttft_seconds`
                    labels[family.name] = names
                for suffix in SAMPLE_SUFFIXES.get(family.type, [""]):
                    labels[family.name + suffix] = names | ({"le"} if suffix == "_bucket" else set())
    return labels


def deploy_exprs() -> list[tuple[str, str]]:
    """(where, PromQL) for every query a deploy file makes: alert rules, Grafana panels, KEDA, the HPA."""
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    exprs = [(f"alert {rule['alert']}", rule["expr"]) for group in rules["groups"] for rule in group["rules"]]
    grafana = json.loads((DEPLOY / "grafana" / "macpool-dashboard.json").read_text())
    exprs += [(f"panel {panel['title']}", target["expr"])
              for panel in grafana["panels"] for target in panel.get("targets", [])]
    for doc in yaml.safe_load_all((DEPLOY / "k8s" / "keda-scaledobject.yaml").read_text()):
        for trigger in doc["spec"].get("triggers", []):
            if trigger["type"] == "prometheus":
                exprs.append((f"KEDA {doc['metadata']['name']}", trigger["metadata"]["query"]))
        for metric in doc["spec"].get("metrics", []):
            if metric["type"] == "External":
                exprs.append((f"HPA {doc['metadata']['name']}", metric["external"]["metric"]["name"]))
    return exprs


PACKAGES = ("macpool", "router", "node_agent")
PACKAGE_SOURCE = "\n".join(path.read_text() for package in PACKAGES for path in (ROOT / package).glob("*.py"))


def set_in_code(value: str) -> bool:
    """A label value appears as a string literal in the router's, agent's or contract's code."""
    return f'"{value}"' in PACKAGE_SOURCE


def test_deploy_queries_name_only_exported_metrics_and_labels(exported_metrics: set[str]) -> None:
    exprs = deploy_exprs()
    where = {w.split()[0] for w, _ in exprs}
    assert {"alert", "panel", "KEDA", "HPA"} <= where and len(exprs) > 10
    alerts = {w.removeprefix("alert ") for w, _ in exprs if w.startswith("alert ")}
    assert {"MacpoolPoolSaturated", "MacpoolNodePaging", "MacpoolNodeGone", "MacpoolRejecting"} <= alerts
    labels = declared_labels()
    target_labels = {"instance", "job"}  # added by Prometheus to every scraped series
    for place, expr in exprs:
        for name in METRIC.findall(expr):
            assert name in exported_metrics, f"{place}: {name} (in {expr!r}) is not exported"
        for name, matchers in re.findall(r"\b(macpool_[a-z0-9_]+)\{([^}]*)\}", expr):
            for label, op, value in re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', matchers):
                assert label in labels[name] | target_labels, f"{place}: {name} has no label {label}"
                if op == "=" and label != "job":  # a label value the code really sets
                    assert set_in_code(value), f"{place}: {name}{{{label}={value!r}}} never set"
        for grouping, name in GROUPED.findall(expr):
            for label in filter(None, (g.strip() for g in grouping.split(","))):
                assert label in labels[name] | target_labels, f"{place}: {name} has no label {label}"


def test_grafana_legends_and_docs_tables_match_the_queries() -> None:
    grafana = json.loads((DEPLOY / "grafana" / "macpool-dashboard.json").read_text())
    for panel in grafana["panels"]:
        assert panel["datasource"]["uid"] == "prometheus", panel["title"]
        for target in panel.get("targets", []):
            grouping = re.findall(r"\bby\s*\(([^)]*)\)", target["expr"])
            grouped = {g.strip() for by in grouping for g in by.split(",")}
            for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")):
                assert label in grouped, f"panel {panel['title']}: legend label {label} not kept by the query"
    provisioning = DEPLOY / "grafana" / "provisioning"
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    assert [d["uid"] for d in datasources["datasources"]] == ["prometheus"]
    documented = re.findall(r"^\| `(Macpool\w+)` \|", (ROOT / "docs" / "operations.md").read_text(), re.M)
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    assert documented == [rule["alert"] for group in rules["groups"] for rule in group["rules"]]
    jobs = {job["job_name"] for name in ("prometheus.yml", "prometheus.compose.yml")
            for job in yaml.safe_load((DEPLOY / "prometheus" / name).read_text())["scrape_configs"]}
    assert jobs == {"macpool-router", "macpool-agent"}
    for doc in ("metrics.md", "operations.md"):
        for job in re.findall(r'job="([^"]+)"', (ROOT / "docs" / doc).read_text()):
            assert job in jobs, f"docs/{doc} names the scrape job {job!r}, which prometheus.yml does not have"


def test_other_deploy_files_parse() -> None:
    router_env = env_names(RouterSettings)
    named: list[str] = []  # MACPOOL_* variables set for the router: a typo would be ignored silently
    for path in (DEPLOY / "k8s").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["apiVersion"] and doc["kind"], path
            named += [key for key in doc.get("stringData", {}) if key.startswith("MACPOOL_")]
            for container in doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
                named += [var["name"] for var in container.get("env", [])]
    example = (DEPLOY / "linux" / "router.env.example").read_text()
    named += re.findall(r"^#? ?(MACPOOL_[A-Z_]+)=", example, flags=re.MULTILINE)
    assert "MACPOOL_LOG_FORMAT" in named
    for name in named:
        assert name in router_env, f"{name} is no setting of macpool router"
    yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    unit = (DEPLOY / "linux" / "macpool-router.service").read_text()
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    _, args = split_command(exec_start.split()[2:])
    assert not unknown_flags(("router",), args)
    if shutil.which("promtool"):
        check = subprocess.run(["promtool", "check", "rules", str(DEPLOY / "prometheus" / "alerts.yml")],
                               capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr
    if shutil.which("haproxy"):
        check = subprocess.run(["haproxy", "-c", "-f", str(DEPLOY / "haproxy" / "haproxy.cfg")],
                               capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr
    if shutil.which("docker-compose"):  # validates against the Compose schema without a Docker engine
        check = subprocess.run(["docker-compose", "--profile", "metrics", "config", "-q"], cwd=ROOT,
                               capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr


def test_the_image_runs_as_a_numeric_non_root_user_and_the_pods_require_it() -> None:
    # a name (USER macpool) cannot be checked by a cluster enforcing runAsNonRoot: it refuses the pod
    users = re.findall(r"^USER\s+(\S+)", (ROOT / "Dockerfile").read_text(), flags=re.MULTILINE)
    assert len(users) == 1 and users[0].split(":")[0].isdigit() and int(users[0].split(":")[0]) > 0, users
    for doc in yaml.safe_load_all((DEPLOY / "k8s" / "router.yaml").read_text()):
        for container in doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            context = container["securityContext"]
            assert context["runAsNonRoot"] is True and context["allowPrivilegeEscalation"] is False
            assert context["capabilities"]["drop"] == ["ALL"]


def test_systemd_accepts_the_unit(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    unit = (DEPLOY / "linux" / "macpool-router.service").read_text()
    # verify wants the program to exist; everything else (keys, values, sections) is checked as written
    (tmp_path / "macpool-router.service").write_text(unit.replace("/opt/macpool/bin/macpool", "/bin/true"))
    check = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "macpool-router.service")],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and not check.stderr.strip(), check.stderr  # unknown keys: stderr only


def test_ci_runs_the_readmes_test_command_verbatim() -> None:
    """README.md opens with two commands; `.ci/run` runs the second one exactly as written."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S)
    assert block is not None and readme.index(block.group(0)) < readme.index("\n## ")
    commands = block.group(1).strip().splitlines()
    assert len(commands) == 2 and commands[0].endswith("macpool demo")
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert ci == [commands[1]]


def haproxy_sections() -> dict[str, list[str]]:
    """haproxy.cfg as {"defaults": [directive, ...], "backend routers": [...], ...}, comments dropped."""
    sections: dict[str, list[str]] = {}
    current: list[str] = []
    for raw in (DEPLOY / "haproxy" / "haproxy.cfg").read_text().splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line:
            continue
        if not line[0].isspace():
            current = sections.setdefault(" ".join(line.split()), [])
        else:
            current.append(" ".join(line.split()))
    return sections


def haproxy_seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)(us|ms|s|m|h|d)?", value)
    assert match is not None, f"not an HAProxy time: {value}"
    units = {"us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1e-3}  # bare: ms
    return int(match.group(1)) * units[match.group(2)]


def test_haproxy_relays_streams_and_refusals_as_the_router_gives_them() -> None:
    """Checked against a real HAProxy 2.6 in front of a real pool: without http-no-delay a stream reached the
    client in bursts ~200 ms apart; without abortonclose an abandoned non-streamed request kept its slot on
    the Mac until the generation ended."""
    sections = haproxy_sections()
    backend = sections["backend routers"]
    directives = sections["defaults"] + backend
    assert "option http-no-delay" in directives
    assert "option abortonclose" in directives
    assert not any(d.startswith(("compression", "option http-buffer-request")) for d in directives)
    timeouts = {d.split()[1]: haproxy_seconds(d.split()[2]) for d in directives if d.startswith("timeout ")}
    defaults = RouterSettings.model_fields
    longest_wait = max(float(defaults[name].default) for name in
                       ("response_timeout", "first_byte_timeout", "idle_timeout"))
    assert timeouts["client"] > longest_wait and timeouts["server"] > longest_wait
    # 503 + Retry-After is the answer for the client: only a connection the router never took is retried
    for directive in directives:
        if directive.startswith("retry-on"):
            assert directive.split()[1:] == ["conn-failure"], directive
    assert "http-check send meth GET uri /health" in backend, "health-check /health (/ready is not one)"
    assert "http-check expect status 200" in backend
    servers = [d for d in backend if d.startswith("server ")]
    assert len(servers) >= 2 and all(" check" in s for s in servers)


def seconds(value: str | int) -> float:
    """A Compose/systemd duration: 30, "30s", "1m30s"."""
    text = str(value).strip()
    if text.isdigit():
        return float(text)
    parts = re.fullmatch(r"(?:(\d+)m(?:in)?)?\s*(?:(\d+)s)?", text)
    assert parts is not None and text, f"not a duration: {value!r}"
    return 60.0 * int(parts.group(1) or 0) + int(parts.group(2) or 0)


def configured(settings_cls: type[Any], name: str, args: list[str], env: dict[str, str]) -> float:
    """A setting as the process would see it: its flag, else its MACPOOL_* variable, else the default."""
    flag = "--" + name.replace("_", "-")
    if flag in args:
        return float(flag_value(args, flag))
    return float(env.get(f"MACPOOL_{name.upper()}", settings_cls.model_fields[name].default))


# after its drain, an agent gives its gateway 1 s and a supervised llama-server 5 s before SIGKILL
AGENT_EXIT_MARGIN = 6.0


def test_every_supervisor_waits_out_the_graceful_shutdown() -> None:
    """Docker, Kubernetes, systemd and launchd kill a process some time after SIGTERM: never before the
    router's --shutdown-timeout or the agent's drain has run out, or requests in flight are cut off."""
    for name, svc in macpool_services().items():
        subcommand, args = split_command(svc["command"])
        env = svc.get("environment", {})
        grace = seconds(svc.get("stop_grace_period", 10))  # Docker's default
        if subcommand == ("router",):
            assert grace > configured(RouterSettings, "shutdown_timeout", args, env), name
        elif subcommand == ("agent", "run"):
            assert grace > configured(AgentSettings, "drain_timeout", args, env) + AGENT_EXIT_MARGIN, name
    deployment = next(doc for doc in yaml.safe_load_all((DEPLOY / "k8s" / "router.yaml").read_text())
                      if doc["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {var["name"]: var["value"] for var in container.get("env", [])}
    _, args = split_command(container["args"])
    pause = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pause[0] == "sleep", "a pause before SIGTERM while the Service drops the pod from its endpoints"
    shutdown = configured(RouterSettings, "shutdown_timeout", args, env)
    assert pod.get("terminationGracePeriodSeconds", 30) > float(pause[1]) + shutdown
    unit_text = (DEPLOY / "linux" / "macpool-router.service").read_text()
    unit = dict(re.findall(r"^(\w+)=(.*)$", unit_text, flags=re.M))
    _, args = split_command(unit["ExecStart"].split()[1:])
    env_text = (DEPLOY / "linux" / "router.env.example").read_text()
    env_file = dict(re.findall(r"^(MACPOOL_[A-Z_]+)=(.*)$", env_text, flags=re.M))
    assert seconds(unit["TimeoutStopSec"]) > configured(RouterSettings, "shutdown_timeout", args, env_file)
    plist = plistlib.loads((DEPLOY / "macos" / "com.macpool.agent.plist").read_bytes())
    agent_toml = tomllib.loads((DEPLOY / "macos" / "agent.toml").read_text())
    drain = float(agent_toml.get("drain_timeout", AgentSettings.model_fields["drain_timeout"].default))
    assert plist["ExitTimeOut"] > drain + AGENT_EXIT_MARGIN


def test_launchd_plist_runs_the_agent_on_the_toml_file_the_guide_writes(tmp_path: Path) -> None:
    macos = DEPLOY / "macos"
    plist = plistlib.loads((macos / "com.macpool.agent.plist").read_bytes())
    program, *argv = plist["ProgramArguments"]
    assert program.endswith("/bin/macpool") and argv[:2] == ["agent", "run"]
    assert not unknown_flags(("agent", "run"), argv[2:])
    config = Path(flag_value(argv, "--config"))
    guide = (macos / "README.md").read_text()
    copied = re.search(r"cp deploy/macos/agent\.toml (\S+)", guide)
    assert copied is not None and config.parts[3:] == Path(copied.group(1)).parts[1:], "the guide's copy"
    assert config.parts[:3] == ("/", "Users", "USER") and program.startswith("/Users/USER/macpool/")
    for name in plist["EnvironmentVariables"]:
        assert name == "PATH" or name in env_names(AgentSettings), f"{name} is no setting of macpool agent"
    keys = tomllib.loads((macos / "agent.toml").read_text())
    assert keys["llama_server"] and keys["model"], "the plist's agent supervises llama-server"
    # the file is read as the Mac reads it (a misspelled key or a bad value fails here), with stand-ins for
    # the Mac's llama-server and model, which are not on this machine
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    stand_ins = ["--llama-server", "true", "--model", str(model)]
    settings = AgentSettings.from_argv(["--config", str(macos / "agent.toml"), *stand_ins])
    assert "node_id" in keys, "each Mac needs its own node id: the default (host name) is shared by clones"
    assert urlparse(settings.advertise_url).port == settings.port
    assert settings.host == "0.0.0.0", "routers on other hosts must reach the agent"
    looked_up = f"\"macpool:{{pool}}:node:{settings.node_id}\" doc"
    assert looked_up in guide, "the guide looks the node up under its node_id"


def test_the_macos_router_daemon_runs_the_router_on_the_toml_file_the_guide_writes() -> None:
    macos = DEPLOY / "macos"
    plist = plistlib.loads((macos / "com.macpool.router.plist").read_bytes())
    program, *argv = plist["ProgramArguments"]
    assert program.endswith("/bin/macpool") and argv[0] == "router"
    assert not unknown_flags(("router",), argv[1:])
    assert plist["UserName"] == "USER" and plist["RunAtLoad"]
    guide = (macos / "README.md").read_text()
    block = re.search(r"## The router on a Mac.*?```toml\n(.*?)```", guide, re.S)
    assert block is not None
    keys = tomllib.loads(block.group(1))
    assert set(keys) <= set(RouterSettings.model_fields), set(keys) - set(RouterSettings.model_fields)
    assert Path(flag_value(argv, "--config")).name == "router.toml"


def test_the_wired_limit_daemon_sets_the_limit_at_boot() -> None:
    plist = plistlib.loads((DEPLOY / "macos" / "com.macpool.wiredlimit.plist").read_bytes())
    program, setting = plist["ProgramArguments"]
    assert program == "/usr/sbin/sysctl" and plist["RunAtLoad"]
    assert re.fullmatch(r"iogpu\.wired_limit_mb=\d+", setting)


# words naming a command: `macpool agent run`, `macpool bench relay`, `macpool dev tiny-model`
SUBCOMMANDS = {"router": 1, "agent": 2, "sim": 1, "demo": 1, "top": 1, "autoscale": 1, "bench": 2, "dev": 2,
               "pool": 2}
PASSED_ON = {("dev", "test")}  # its arguments are pytest's
# every table of flags in the guides, by (guide, its n-th flag table): the command whose flags it lists
FLAG_TABLES = {
    ("docs/router.md", 0): ("router",),
    ("docs/agent.md", 0): ("agent", "run"),
    ("docs/operations.md", 0): ("agent", "run"),  # the elastic pool's agent flags
    ("docs/operations.md", 1): ("autoscale",),
}
# the TOML files of settings in deploy/, by the command whose settings they are (its table or top-level keys)
SETTINGS_MODELS: dict[str, type[Any]] = {
    "router": RouterSettings, "agent": AgentSettings, "autoscale": AutoscaleSettings
}


def guides() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(DEPLOY.rglob("*.md"))]


def documented_commands(path: Path) -> list[list[str]]:
    """Every `macpool ...` command line in a guide's code blocks and inline code, as words."""
    text = path.read_text()
    lines = [line for block in re.findall(r"```\w*\n(.*?)```", text, re.S)
             for line in block.replace("\\\n", " ").splitlines()]
    lines += re.findall(r"`([^`\n]*macpool [a-z][^`\n]*)`", text)
    commands = []
    for line in lines:
        found = re.search(r"(?:^|[\s/])macpool\s+([a-z].*)", line.split(" # ")[0])
        if found and found.group(1).split()[0] in SUBCOMMANDS:
            commands.append(found.group(1).split())
    return commands


def command_problems(path: Path) -> list[str]:
    """The flags a guide's `macpool <command> ... --flag` lines give that the command does not take."""
    problems = []
    for words in documented_commands(path):
        command = tuple(words[: SUBCOMMANDS[words[0]]])
        if command in PASSED_ON or any(word.startswith("<") for word in command):  # `macpool bench <name>`
            continue
        args = words[len(command):]
        args = args[: args.index("--")] if "--" in args else args  # the rest goes to llama-server
        problems += [f"macpool {' '.join(words)}: {flag}" for flag in unknown_flags(command, args)]
    return problems


def flag_tables(path: Path) -> list[list[str]]:
    """A guide's tables whose first column is `flag`: each one's first cells, past the head."""
    tables = re.findall(r"^\| flag \|.*\n\|[-| ]+\|\n((?:\|.*\n?)+)", path.read_text(), re.M)
    return [[row.split("|")[1] for row in table.splitlines()] for table in tables]


def table_problems(path: Path, name: str) -> list[str]:
    """The flags a guide's tables name that their command does not take, and tables of no known command."""
    problems = []
    for n, cells in enumerate(flag_tables(path)):
        command = FLAG_TABLES.get((name, n))
        if command is None:
            problems.append(f"{name}: flag table {n} is of no command in FLAG_TABLES")
            continue
        flags = [flag for cell in cells for code in re.findall(r"`([^`]*)`", cell)
                 for flag in re.findall(r"(?<![\w-])--?[a-z][\w-]*", code)]
        problems += [f"{name}, a table of macpool {' '.join(command)}: {flag}"
                     for flag in unknown_flags(command, flags)]
    return problems


@pytest.mark.parametrize("guide", [str(path.relative_to(ROOT)) for path in guides()])
def test_every_flag_a_guide_names_is_one_its_command_takes(guide: str) -> None:
    path = ROOT / guide
    assert command_problems(path) + table_problems(path, guide) == []


def test_the_guides_show_commands_and_every_flag_table_is_checked() -> None:
    assert sum(len(documented_commands(path)) for path in guides()) >= 100
    tables = {(str(path.relative_to(ROOT)), n) for path in guides() for n in range(len(flag_tables(path)))}
    assert tables == set(FLAG_TABLES)


def test_a_guide_naming_a_flag_no_command_takes_fails(tmp_path: Path) -> None:
    guide = tmp_path / "guide.md"
    guide.write_text(
        "Run `macpool router --port 8080 --no-such-flag 3`, then:\n\n```sh\n"
        "macpool agent run --upstream http://127.0.0.1:8081 \\\n"
        "  --heartbeat-intervall 2 -- --port 9\n```\n\n"
        "| flag | env | default | meaning |\n|---|---|---|---|\n| `--port` | x | 1 | y |\n"
        "| `--lease-time S` | x | 1 | y |\n"
    )
    assert command_problems(guide) == [  # code blocks, then inline code
        "macpool agent run --upstream http://127.0.0.1:8081 --heartbeat-intervall 2 -- --port 9: "
        "--heartbeat-intervall",
        "macpool router --port 8080 --no-such-flag 3: --no-such-flag",
    ]
    assert table_problems(guide, "docs/router.md") == [
        "docs/router.md, a table of macpool router: --lease-time"
    ]
    assert table_problems(guide, "docs/new.md") == [
        "docs/new.md: flag table 0 is of no command in FLAG_TABLES"
    ]


def test_the_systemd_units_and_pods_start_commands_with_real_flags() -> None:
    started = [line.split("/bin/macpool", 1)[1].split() for unit in sorted(DEPLOY.rglob("*.service"))
               for line in re.findall(r"^ExecStart=(.*)$", unit.read_text(), re.M)]
    for manifest in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(manifest.read_text()):
            pod = (doc or {}).get("spec", {}).get("template", {}).get("spec", {})
            containers = pod.get("containers", [])
            started += [c["args"] for c in containers if c.get("image", "").startswith("macpool")]
    assert len(started) >= 3
    for words in started:
        command = tuple(words[: SUBCOMMANDS[words[0]]])
        assert not unknown_flags(command, words[len(command):]), f"macpool {' '.join(words)}"


def toml_problems(path: Path) -> list[str]:
    """The keys of a deploy TOML file (commented-out top-level ones too) that its command has no setting
    of."""
    text = path.read_text()
    data = tomllib.loads(text)
    command = next((name for name in SETTINGS_MODELS if isinstance(data.get(name), dict)), path.stem)
    if command not in SETTINGS_MODELS:
        return [f"{path.name}: the settings of no command (name it agent.toml, router.toml, autoscale.toml)"]
    values = data.get(command, data)
    head = re.split(r"^#?\s*\[", text, maxsplit=1, flags=re.M)[0]  # before the first table, even commented
    named = {*values, *re.findall(r"^#\s*([a-z][a-z0-9_-]*)\s*=", head, re.M)}
    known = set(keys(SETTINGS_MODELS[command])) | set(SETTINGS_MODELS[command].model_fields)
    return [f"{path.name}: {key} is no setting of macpool {command}"
            for key in sorted(named) if key.replace("-", "_") not in known]


def test_every_key_of_the_deploy_toml_files_is_a_setting(tmp_path: Path) -> None:
    files = sorted(DEPLOY.rglob("*.toml"))
    assert files
    assert [problem for path in files for problem in toml_problems(path)] == []
    misspelled = tmp_path / "agent.toml"
    misspelled.write_text('upstream = "http://127.0.0.1:1"\n# heartbeat_intervall = 2\n[models]\n')
    assert toml_problems(misspelled) == ["agent.toml: heartbeat_intervall is no setting of macpool agent"]


def test_systemd_unit_runs_what_the_install_steps_put_in_place() -> None:
    unit_text = (DEPLOY / "linux" / "macpool-router.service").read_text()
    unit = dict(re.findall(r"^(\w+)=(.*)$", unit_text, flags=re.M))
    guide = (ROOT / "docs" / "operations.md").read_text()
    for steps in (unit_text, guide):
        venv = re.search(r"python3 -m venv (\S+) && sudo (\S+)/bin/pip install \.", steps)
        assert venv is not None and venv.group(1) == venv.group(2)
        assert unit["ExecStart"].split()[0] == f"{venv.group(1)}/bin/macpool"
        env_file = re.search(r"-g (\w+) (?:deploy/linux/)?router\.env\.example (\S+)", steps)
        assert env_file is not None and env_file.group(2) == unit["EnvironmentFile"]
        assert env_file.group(1) == unit["Group"]
        assert f"useradd --system --no-create-home {unit['User']}" in steps
        assert "install -m 0644 " in steps and "/etc/systemd/system/" in steps


def test_guides_and_deploy_files_name_only_real_environment_variables() -> None:
    known = env_names(RouterSettings) | env_names(AgentSettings) | env_names(AutoscaleSettings)
    known |= {"MACPOOL_ROUTER_URL"}  # macpool top
    files = [ROOT / "docs" / "operations.md", ROOT / "docker-compose.yml", ROOT / "Dockerfile"]
    files += [path for path in DEPLOY.rglob("*") if path.is_file()]
    for path in files:
        for name in re.findall(r"\bMACPOOL_[A-Z][A-Z_]*[A-Z]\b", path.read_text()):
            assert name in known, f"{path.relative_to(ROOT)}: {name} is no setting of a macpool process"


def test_the_log_lines_worth_alerting_on_are_ones_the_code_writes() -> None:
    guide = (ROOT / "docs" / "operations.md").read_text()
    sentence = re.search(r"Worth alerting on:(.*?)\(agent\)\.", guide, re.S)
    assert sentence is not None
    phrases = re.findall(r"`([^`]+)`", sentence.group(1))
    assert len(phrases) >= 6
    for phrase in phrases:
        assert phrase in PACKAGE_SOURCE, f"no log message says {phrase!r}: an alert on it would never fire"


def test_the_docs_name_metrics_with_their_real_labels() -> None:
    """`macpool_x{label}` and `macpool_x{label="value"}` in the guides: a metric and labels the code has."""
    labels = declared_labels()
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    seen = 0
    for doc in docs:
        for name, inside in re.findall(r"\b(macpool_[a-z0-9_]+)\{([^}]*)\}", doc.read_text()):
            seen += 1
            assert name in labels, f"{doc.name}: {name} is no metric of the router or the agent"
            for label in re.findall(r"(\w+)\s*(?:=|,|$)", inside):
                assert label in labels[name], f"{doc.name}: {name} has no label {label}"
    assert seen >= 5


def keys(settings_cls: type[Any]) -> dict[str, FieldInfo]:
    """A settings model's fields by the key each goes by: its alias (the router's scale_*), else its name."""
    return {field.validation_alias if isinstance(field.validation_alias, str) else name: field
            for name, field in settings_cls.model_fields.items()}


def parser(settings_cls: type[Any]) -> argparse.ArgumentParser:
    """The parser a settings model makes its command's flags with."""
    parser: argparse.ArgumentParser = CliSettingsSource(settings_cls).root_parser
    return parser


def documented_settings(guide: str, heading: str) -> list[tuple[str, str, str]]:
    """A guide's configuration table: (flag, env or key, default) per row."""
    section = (ROOT / "docs" / guide).read_text().split(heading, 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| (.*?) \| (.*?) \| (.*?) \| (.*?) \|$", section, re.M)[1:]  # past the head
    return [(flag, key, default) for flag, key, default, _ in rows]


def default_matches(field: Any, documented: str) -> bool:
    """A concrete default must be the code's; a setting unset by default (or computed at start) may say what
    that means ("unset", "host name", "`/props` total_slots")."""
    computed = field.default_factory not in (None, list)  # the router id, the host name
    value = None if computed else field.get_default(call_default_factory=True)
    documented = documented.strip("`")
    if value is None or value == "" or value == {}:  # an empty table: unset
        return not re.fullmatch(r"[\d.]+|on|off", documented)
    if isinstance(value, bool):
        return documented == ("on" if value else "off")
    if isinstance(value, int | float):
        return re.fullmatch(r"[\d.]+", documented) is not None and float(documented) == value
    return documented == str(value)


def test_the_router_configuration_table_is_every_setting_with_its_flag_env_and_default() -> None:
    table = documented_settings("router.md", "## Configuration")
    flags = {option for action in parser(RouterSettings)._actions for option in action.option_strings}
    flags -= {"-h", "--help"}
    names = set()
    for column, env, default in table:
        flag = column.strip("`")
        name = flag[2:].replace("-", "_")
        names.add(name)
        assert flag in flags, f"docs/router.md documents {flag}, which `macpool router` does not take"
        assert env.strip("`").split("=")[0] == f"MACPOOL_{name.upper()}", f"docs/router.md, {flag}: {env}"
        field = keys(RouterSettings).get(name)
        assert field is not None, f"docs/router.md documents {flag}: no such router setting"
        assert default_matches(field, default), f"docs/router.md, {flag}: default {default} in the docs"
    assert names == set(keys(RouterSettings)), "docs/router.md's table misses a router setting"
    documented = {column.strip("`") for column, _, _ in table}
    switches = {f"--no-{flag[2:]}" for flag in documented}  # an on/off flag's other way (--no-affinity)
    undocumented = flags - documented - switches - {"--config"}
    assert not undocumented, f"`macpool router` flags missing from docs/router.md: {undocumented}"


def test_the_agent_configuration_table_is_every_setting_with_its_flag_key_and_default() -> None:
    table = documented_settings("agent.md", "## Configuration reference")
    name = {key: field_name for field_name in AgentSettings.model_fields
            for key in (field_name, AgentSettings.model_fields[field_name].validation_alias)}
    dests = {option: name[action.dest] for action in parser(AgentSettings)._actions
             for option in action.option_strings if action.dest != "help"}
    keys = set()
    for column, key_env, default in table:
        if column.startswith("`--config"):
            continue
        key = re.findall(r"`(\w+)`", key_env)[-1]
        keys.add(key)
        field = AgentSettings.model_fields.get(key)
        assert field is not None, f"docs/agent.md documents the key {key}: no such agent setting"
        for env in re.findall(r"`(MACPOOL_\w+)`", key_env):
            assert env in env_names(AgentSettings), f"docs/agent.md, {key}: the agent does not read {env}"
        for flag in re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", column.split("`")[1] if "`" in column else ""):
            if flag != "--":
                assert dests.get(flag) == key, f"docs/agent.md: {flag} is not `macpool agent run`'s {key}"
        assert default_matches(field, default), f"docs/agent.md, {key}: default {default} in the docs"
    assert keys == set(AgentSettings.model_fields) - {"config"}, "docs/agent.md's table misses a setting"
    undocumented = {dest for dest in dests.values() if dest not in keys} - {"config"}
    assert not undocumented, f"`macpool agent run` flags missing from docs/agent.md: {undocumented}"
