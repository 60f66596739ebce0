"""runbooks/: one per alert (linked from the alert), the required incidents, and commands that exist.

`flotilla` commands are parsed by the real parser (flotilla.cli.build_parser), `ray` commands by
Ray's own click CLI (subcommands and flags), `kubectl`/`helm` only by verb (no binary here).
PromQL blocks are evaluated against a live Prometheus in test_prometheus.py.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest
import yaml
from ray.scripts.scripts import cli as ray_cli

from flotilla.cli import build_parser
from scripts.render_manifests import RULES
from tests.deploy.runbook_commands import RUNBOOKS, blocks, program_argv, runbook_files, shell_commands

INCIDENTS = (
    "node-loss.md",
    "collective-hang.md",
    "oom.md",
    "slow-model-load.md",
    "rolling-upgrade.md",
    "api-key-rotation.md",
)
SECTIONS = ("## Symptoms", "## Alert", "## Diagnose", "## Mitigate", "## Verify recovery")
KUBECTL_VERBS = {
    "get", "describe", "logs", "exec", "top", "cordon", "uncordon", "drain", "delete", "port-forward",
    "rollout", "apply", "annotate", "label", "scale", "events", "create",
}  # fmt: skip
HELM_VERBS = {"history", "upgrade", "rollback", "test", "status", "install", "uninstall", "get"}


def alerts() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


@pytest.mark.parametrize("alert", alerts(), ids=lambda a: a["alert"])
def test_every_alert_links_to_its_runbook(alert: dict) -> None:
    url = alert["annotations"]["runbook_url"]
    runbook = RUNBOOKS / url.rsplit("/", 1)[1]
    assert runbook.is_file(), url
    assert runbook.read_text().startswith(f"# {alert['alert']}:")
    assert alert["labels"]["severity"] in ("warning", "critical")


def test_incident_runbooks_exist() -> None:
    assert {p.name for p in runbook_files()} >= set(INCIDENTS)
    linked = {a["annotations"]["runbook_url"].rsplit("/", 1)[1] for a in alerts()}
    assert {p.name for p in runbook_files()} == linked | set(INCIDENTS)  # no orphan runbooks


@pytest.mark.parametrize("path", runbook_files(), ids=lambda p: p.name)
def test_runbook_has_every_section_and_runnable_commands(path: Path) -> None:
    text = path.read_text()
    positions = [text.find(section) for section in SECTIONS]
    assert -1 not in positions and positions == sorted(positions), f"sections in order: {SECTIONS}"
    assert any(where == path.name for where, _ in blocks("bash"))
    assert any(where == path.name for where, _ in blocks("promql"))


def _flotilla_commands() -> list[tuple[str, list[str]]]:
    found = []
    for where, argv in shell_commands():
        words = [argv, *(shlex.split(w) for w in argv if " " in w)]  # also inside `ray exec … '<cmd>'`
        found += [(where, args) for w in words if (args := program_argv(w, "flotilla")) is not None]
    return found


def _ray_commands() -> list[tuple[str, list[str]]]:
    return [(where, args) for where, argv in shell_commands() if (args := program_argv(argv, "ray")) is not None]


def test_runbooks_use_flotilla_ray_and_kubectl() -> None:
    programs = {argv[0] for _, argv in shell_commands()}
    assert {"kubectl", "ray"} <= programs
    assert len(_flotilla_commands()) >= 20
    used = {args[0] for _, args in _flotilla_commands()}
    assert {"status", "drain", "resume", "restart", "plan", "eplb-demo"} <= used


@pytest.mark.parametrize("where, args", _flotilla_commands(), ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_flotilla_command_parses(where: str, args: list[str]) -> None:
    parser = build_parser()
    parser.exit = _raise  # type: ignore[method-assign]  # argparse errors exit; make them test failures
    for action in parser._subparsers._group_actions:  # type: ignore[union-attr]
        for sub in action.choices.values():
            sub.exit = _raise  # type: ignore[method-assign]
    parser.parse_args(args)


def _raise(status: int = 0, message: str | None = None) -> None:
    raise AssertionError(f"flotilla rejects these arguments: {message}")


@pytest.mark.parametrize("where, args", _ray_commands(), ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_ray_command_is_a_real_subcommand_with_real_flags(where: str, args: list[str]) -> None:
    command: click.Command = ray_cli
    ctx = command.make_context("ray", list(args), resilient_parsing=False)
    rest = [*ctx._protected_args, *ctx.args] if hasattr(ctx, "_protected_args") else [*ctx.protected_args, *ctx.args]
    while isinstance(command, click.Group):
        name, command, rest = command.resolve_command(ctx, rest)
        assert command is not None, f"ray has no subcommand {name!r}"
        ctx = command.make_context(name, rest, parent=ctx)  # raises on an unknown flag
        rest = (
            [*getattr(ctx, "_protected_args", ctx.protected_args), *ctx.args]
            if isinstance(command, click.Group)
            else []
        )


def test_kubectl_and_helm_verbs_exist() -> None:
    unknown = []
    for where, argv in shell_commands():
        if argv[0] not in ("kubectl", "helm"):
            continue
        words = [w for w in argv[1:] if not w.startswith("-")]
        flags_with_values = {"-n", "--namespace", "-f", "-l", "-c", "-o", "--tail", "--sort-by", "--field-selector"}
        verb = next(
            w for i, w in enumerate(argv[1:], 1) if not w.startswith("-") and argv[i - 1] not in flags_with_values
        )
        allowed = KUBECTL_VERBS if argv[0] == "kubectl" else HELM_VERBS
        if verb not in allowed:
            unknown.append(f"{where}: {' '.join(argv)}")
        assert words
    assert unknown == []


def test_ray_is_checked_against_unknown_flags() -> None:
    with pytest.raises(click.UsageError):
        test_ray_command_is_a_real_subcommand_with_real_flags("self-check", ["list", "actors", "--no-such-flag"])
    with pytest.raises(AssertionError, match="rejects"):
        test_flotilla_command_parses("self-check", ["drain"])  # the group is required


def test_promql_blocks_are_not_shell() -> None:
    for where, body in blocks("promql"):
        assert not re.search(r"^\s*(kubectl|ray|flotilla)\b", body, re.M), where


def test_advice_to_change_groups_says_what_it_costs_in_kuberay_mode() -> None:
    """In kuberay mode a changed `config.groups` builds a whole second RayCluster (2× accelerators):
    every runbook paragraph that suggests changing it must say so."""
    paragraphs = [
        (path.name, para)
        for path in runbook_files()
        for para in re.split(r"\n\s*\n|\n(?=\d+\. |- )", path.read_text())
        if "config.groups" in para
    ]
    assert paragraphs
    silent = [(where, para) for where, para in paragraphs if "RayCluster" not in para]
    assert silent == []


def test_no_runbook_claims_drain_and_restart_upgrades_groups() -> None:
    """Groups are recreated from the spec `flotilla serve` read at start-up: only new pods upgrade."""
    text = (RUNBOOKS / "rolling-upgrade.md").read_text()
    assert "replace groups one by one inside the\n  running cluster instead, drain and restart" not in text
    assert "upgrades\nnothing" in text or "upgrades nothing" in text


# `ray` subcommands of the cluster launcher, run on the operator's machine with a cluster YAML.
RAY_LAUNCHER = {"exec", "up", "down", "attach", "submit", "rsync-up", "rsync-down", "get-head-ip", "monitor"}
# `flotilla` subcommands that need no cluster (they run anywhere).
FLOTILLA_OFFLINE = {"plan", "eplb-demo", "make-model"}


def test_commands_that_need_the_cluster_say_where_they_run() -> None:
    """`ray status`, `ray list …`, `flotilla status` … read the running Ray cluster: typed on an
    operator's machine they fail or, worse, read another cluster. They must name `kubectl exec … --`
    (or `ray exec <cluster.yaml>` for `ray up` clusters)."""
    bare = []
    for where, argv in shell_commands():
        program = argv[0].rsplit("/", 1)[-1]
        sub = next((w for w in argv[1:] if not w.startswith("-")), "")
        if program == "ray" and sub not in RAY_LAUNCHER:
            bare.append(f"{where}: {' '.join(argv)}")
        if program == "flotilla" and sub not in FLOTILLA_OFFLINE:
            bare.append(f"{where}: {' '.join(argv)}")
    assert bare == []
    inside = [(where, args) for where, args in _ray_commands() if args[0] not in RAY_LAUNCHER]
    assert inside  # the ray commands are still there, behind kubectl exec
    assert all(where for where, _ in inside)


def test_the_checks_above_fail_on_a_bare_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import tests.deploy.test_runbooks as module

    monkeypatch.setattr(module, "shell_commands", lambda: [("x.md", ["ray", "status"])])
    with pytest.raises(AssertionError):
        test_commands_that_need_the_cluster_say_where_they_run()


def test_cordoning_is_never_said_to_move_a_group() -> None:
    """A cordon only keeps new pods off a node: the group's pods (and so its ranks) stay on it."""
    paragraphs = [
        (path.name, para)
        for path in runbook_files()
        for para in re.split(r"\n\s*\n|\n(?=\d+\. |- )", path.read_text())
        if re.search(r"(?<!un)cordon(?!ed node)", para, re.I) and not para.lstrip().startswith("```")
    ]
    assert paragraphs
    misleading = [
        (where, para)
        for where, para in paragraphs
        if not re.search(r"moves nothing|delete|drain|node-loss\.md", para) and "kubectl cordon" not in para
    ]
    assert misleading == []
    assert "Cordon the suspect node so the restart lands elsewhere" not in (RUNBOOKS / "restart-storm.md").read_text()


def test_lws_partitioned_node_pods_are_force_deleted_in_node_loss() -> None:
    text = (RUNBOOKS / "node-loss.md").read_text()
    assert "Terminating" in text
    assert any(
        argv[:2] == ["kubectl", "-n"] and "delete" in argv and "--force" in argv and "--grace-period=0" in argv
        for where, argv in shell_commands()
        if where == "node-loss.md"
    )


def test_routing_changes_through_the_admin_api_say_what_they_reach_and_how_long_they_last() -> None:
    mentions = 0
    for path in runbook_files():
        text = path.read_text()
        if "/admin/routing" in text:
            mentions += 1
            assert "every ingress replica" in text and "config.routing" in text, path.name
            assert "only the ingress replica" not in text, path.name  # no longer true: the coordinator keeps it
            # lws mode: one Ray cluster per LWS group, so the change is sent to each leader, inside its pod
            assert any(
                argv[:2] == ["kubectl", "-n"] and "exec" in argv and "/admin/routing" in " ".join(argv)
                for where, argv in shell_commands()
                if where == path.name
            ), path.name
    assert mentions
