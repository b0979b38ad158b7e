"""Settings built from the registries (issue 23): an actuator or a kind of alert destination declares its
own name and settings, `logdx.config` builds `actions.<actuator>` and the lists of `alerts` from them, the
reference (docs/configuration.md) is generated from the models, and the keys that moved say where to.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from pydantic import Field, ValidationError

from logdx.act.actions import Actions
from logdx.act.actuators import ACTUATORS, KubernetesActuator, NodeName, SlurmActuator
from logdx.act.actuators.kubernetes import KubernetesSettings
from logdx.act.alerts import DESTINATIONS, Alert
from logdx.act.alerts.base import dest_key
from logdx.act.alerts.outbox import Outbox
from logdx.act.alerts.webhook import WebhookDestination
from logdx.act.render import recommended_action
from logdx.act.report import Report
from logdx.cli.app import main
from logdx.cli.config import settings_reference
from logdx.config import ActionsSettings, ConfigError, load_settings
from logdx.settings_base import Section
from logdx.testing import failed_report

REPO = Path(__file__).resolve().parents[1]


def fresh_config(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """`logdx.config` executed anew, as in a process whose registries hold an entry before it is first
    imported. It is `logdx.config` for the test (pydantic resolves the models' annotations there); the
    modules that imported the first one keep theirs, and the first one is back after the test."""
    spec = importlib.util.find_spec("logdx.config")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "logdx.config", module)
    spec.loader.exec_module(module)
    return module


# -- a new actuator: one module (here, one class) and one line in the registry ---------------------


class NodeFileSettings(Section):
    """How the node-file actuator records a cordon."""

    path: Path = Field(Path("/var/lib/logdx/cordoned"), description="cordoned nodes are appended here, one a line")


class NodeFileActuator:
    """A real actuator, as a site would write one: cordoning appends the node to a file its scheduler
    reads, uncordoning takes it out."""

    name = "nodefile"
    Settings = NodeFileSettings

    def __init__(self, settings: NodeFileSettings) -> None:
        self.path = settings.path

    def describe(self, node: NodeName, job_id: str, report: Report) -> str:
        return f"append {node} to {self.path}"

    def cordon(self, node: NodeName, job_id: str, report: Report) -> str:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(f"{node}\n")
        return f"appended {node} to {self.path}"

    def describe_uncordon(self, node: NodeName) -> str:
        return f"remove {node} from {self.path}"

    def uncordon(self, node: NodeName) -> str:
        kept = [line for line in self.path.read_text(encoding="utf-8").splitlines() if line != node]
        self.path.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
        return f"removed {node} from {self.path}"


@pytest.fixture
def with_nodefile(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.setitem(ACTUATORS, NodeFileActuator.name, NodeFileActuator)
    return fresh_config(monkeypatch)


def test_a_registered_actuator_gets_its_own_section_and_can_be_chosen(with_nodefile, tmp_path, db) -> None:
    nodes = tmp_path / "cordoned.txt"
    cfg = tmp_path / "logdx.yaml"
    cfg.write_text(f"actions:\n  actuator: nodefile\n  dry_run: false\n  nodefile: {{path: {nodes}}}\n")
    settings = with_nodefile.load_settings(cfg, env={})
    assert settings.actions.actuator_settings() == NodeFileSettings(path=nodes)
    [rec] = Actions(db, settings.actions).apply("job-1", failed_report())
    assert (rec.action, rec.actuator, rec.outcome) == ("cordon", "nodefile", "ok")
    assert nodes.read_text() == "node-17\n"
    # Its knob from the environment, as any other; a misspelt choice names it.
    other = tmp_path / "other.txt"
    env = {"LOGDX_ACTIONS__ACTUATOR": "nodefile", "LOGDX_ACTIONS__NODEFILE__PATH": str(other)}
    assert with_nodefile.load_settings(env=env).actions.actuator_settings() == NodeFileSettings(path=other)
    with pytest.raises(with_nodefile.ConfigError, match=r"did you mean nodefile\?"):
        with_nodefile.load_settings(env={"LOGDX_ACTIONS__ACTUATOR": "nodefiel"})


def test_a_registered_actuator_is_in_the_reference(with_nodefile) -> None:
    reference = settings_reference(with_nodefile.Settings)
    assert "| `actions.nodefile.path` | path | `/var/lib/logdx/cordoned` | cordoned nodes are appended here, one a line |" \
        in reference
    [choice_row] = [row for row in reference.splitlines() if row.startswith("| `actions.actuator` |")]
    assert all(f"`{name}`" in choice_row for name in ["nodefile", *ACTUATORS]), choice_row  # the registry's, and ours


def test_an_actuator_section_without_defaults_is_refused_when_the_settings_are_built(monkeypatch) -> None:
    class Required(Section):
        url: str = Field(description="no default: the section could not exist unchosen")

    class NeedsURL(NodeFileActuator):
        name = "needsurl"
        Settings = Required  # type: ignore[assignment]

    monkeypatch.setitem(ACTUATORS, NeedsURL.name, NeedsURL)
    with pytest.raises(TypeError, match=r"actions\.needsurl\.url needs a default"):
        fresh_config(monkeypatch)


def test_without_registration_there_is_no_such_actuator(tmp_path) -> None:
    cfg = tmp_path / "logdx.yaml"
    cfg.write_text("actions: {actuator: nodefile}\n")
    with pytest.raises(ConfigError, match=f"is not an actuator: one of none, {', '.join(ACTUATORS)} "):
        load_settings(cfg, env={})


# -- a new kind of alert destination ----------------------------------------------------------------


class PlainSettings(Section):
    """One plain-text POST per alert."""

    url: str = Field(description="where the text is POSTed")


class PlainDestination:
    kind = "plain"
    config_key = "plain"
    Settings = PlainSettings

    def __init__(self, settings: PlainSettings, index: int = 0) -> None:
        self.url = settings.url
        self.key = dest_key(self.kind, self.url)
        self.label = f"plain[{index}]"

    def body(self, alert: Alert, report_url: str | None, now: float) -> bytes:
        return f"{alert.job_id}: {recommended_action(alert.report)}".encode()

    def headers(self, msg_id: str, body: bytes) -> dict[str, str]:
        return {"content-type": "text/plain"}


def test_a_registered_destination_kind_gets_its_list_and_is_delivered_to(monkeypatch, receiver, tmp_path, db) -> None:
    registry = importlib.import_module("logdx.act.alerts.destinations")
    monkeypatch.setattr(registry, "DESTINATIONS", (*DESTINATIONS, PlainDestination))
    config = fresh_config(monkeypatch)
    with receiver.Receiver() as rx:
        cfg = tmp_path / "logdx.yaml"
        cfg.write_text(f"alerts:\n  plain: [{{url: '{rx.url}/plain'}}]\n")
        settings = config.load_settings(cfg, env={})
        assert settings.alerts.has_destinations()
        out = Outbox(db, settings.alerts)
        assert out.enqueue("job-1", failed_report())
        assert out.deliver_due() == 1
        [req] = rx.wait_for(1)
    assert (req.path, req.body) == ("/plain", f"job-1: {recommended_action(failed_report())}".encode())


# -- keys that moved --------------------------------------------------------------------------------


# What each registered actuator's section says it took over from `actions` (its `moved_here`).
_MOVED_INTO_ACTUATORS = [(old, f"{name}.{new}") for name, cls in ACTUATORS.items()
                         for old, new in cls.Settings.moved_here.items()]


def test_some_actuator_keys_moved() -> None:
    assert _MOVED_INTO_ACTUATORS  # the shipped actuators took keys over from `actions`: the test below runs


@pytest.mark.parametrize("old, new", _MOVED_INTO_ACTUATORS)
def test_an_old_actuator_key_fails_naming_its_new_place(tmp_path, old: str, new: str) -> None:
    cfg = tmp_path / "logdx.yaml"
    cfg.write_text(f"actions:\n  actuator: none\n  {old}: x\n")
    with pytest.raises(ConfigError) as e:
        load_settings(cfg, env={})
    assert str(e.value) == f"{cfg}: actions.{old} moved to actions.{new}"
    variable = f"LOGDX_ACTIONS__{old.upper()}"
    with pytest.raises(ConfigError) as e:
        load_settings(env={variable: "x"})
    new_variable = "LOGDX_ACTIONS__" + new.replace(".", "__").upper()
    assert str(e.value) == f"{variable}: actions.{old} moved to actions.{new} (set {new_variable})"
    with pytest.raises(ValidationError, match=f"{old} moved to {new}"):
        ActionsSettings.model_validate({old: "x"})


# -- nested settings from the environment -----------------------------------------------------------


def test_an_actuators_knob_comes_from_the_environment_over_the_file(tmp_path) -> None:
    kube, slurm = KubernetesActuator.name, SlurmActuator.name  # the names their classes declare
    cfg = tmp_path / "logdx.yaml"
    cfg.write_text(f"actions:\n  actuator: {kube}\n  {kube}: {{api: 'https://kube.example:6443', token: file}}\n")
    var = f"LOGDX_ACTIONS__{kube.upper()}__"
    s = load_settings(cfg, env={f"{var}TOKEN": "t0ken", f"{var}TAINT": "true"})
    assert s.actions.actuator_settings() == KubernetesSettings(api="https://kube.example:6443", token="t0ken", taint=True)
    with pytest.raises(ConfigError, match=rf"did you mean {var}TOKEN\?"):
        load_settings(env={f"{var}TOKN": "t0ken"})
    unchosen = {f"LOGDX_ACTIONS__{slurm.upper()}__SCONTROL": "/opt/slurm/bin/scontrol"}
    assert load_settings(env=unchosen).actions.actuator_settings() is None


def test_a_destination_list_from_the_environment_is_built_by_its_kind() -> None:
    var = f"LOGDX_ALERTS__{WebhookDestination.config_key.upper()}"  # the list the class declares
    s = load_settings(env={var: '[{"url": "https://hooks.example.com/x"}]'})
    [webhook] = s.alerts.destination_settings(WebhookDestination)
    assert webhook.url == "https://hooks.example.com/x"
    assert all(s.alerts.destination_settings(d) == [] for d in DESTINATIONS if d is not WebhookDestination)
    with pytest.raises(ConfigError, match=f"alerts.{WebhookDestination.config_key}.0.secret"):
        load_settings(env={var: '[{"url": "https://hooks.example.com/x", "secret": "plain"}]'})


# -- the reference ------------------------------------------------------------------------------------


def test_the_committed_reference_is_the_settings(capsys) -> None:
    assert main(["config", "reference"]) == 0
    printed = capsys.readouterr().out
    assert printed == settings_reference()
    committed = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert committed == printed, "docs/configuration.md is stale: logdx config reference > docs/configuration.md"


def test_the_reference_names_every_setting_once() -> None:
    from logdx.config import env_names

    rows = [row.split("`")[1] for row in settings_reference().splitlines() if row.startswith("| `")]
    leaves = {row for row in rows if "[]" not in row}
    assert len(rows) == len(set(rows))
    dotted = {"LOGDX_" + name.replace(".", "__").upper() for name in leaves if "." in name}
    # section rows: the actuators' own (from the registry) and the other sub-sections of `actions`
    sections = {f"LOGDX_ACTIONS__{name.upper()}" for name, f in ActionsSettings.model_fields.items()
                if isinstance(f.annotation, type) and issubclass(f.annotation, Section)}
    assert {f"LOGDX_ACTIONS__{name.upper()}" for name in ACTUATORS} <= sections
    assert dotted - sections == set(env_names()) - {"LOGDX_DATA_DIR"}
