"""`jetrl tenants`: the registry it keeps and the authorization it generates."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from jetrl.bus.streams import view_stream_name
from jetrl.deploy.cli import main
from jetrl.deploy.tenants import TenantRegistry, permissions


def test_add_list_rotate_join_leave_remove(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = str(tmp_path / "t")
    assert (
        main(["tenants", "--dir", d, "add", "acme", "--run", "r1", "--api-key", "--max-in-flight", "2"]) == 0
    )
    out = capsys.readouterr().out
    key = out.split("shown once): ")[1].split()[0]
    reg = TenantRegistry(d)
    seed = json.loads(reg.creds_path("acme").read_text())["seed"]
    assert seed not in out and key not in json.dumps(reg.api_keys)  # shown once, kept as a hash
    assert list(reg.api_keys.values()) == [{"tenant": "acme", "max_in_flight": 2}]
    assert stat.S_IMODE(reg.creds_path("acme").stat().st_mode) == 0o600
    old_key = reg.identities["acme"].public_key

    assert main(["tenants", "--dir", d, "join", "acme", "r2"]) == 0
    assert main(["tenants", "--dir", d, "rotate", "acme"]) == 0
    reg = TenantRegistry(d)
    assert reg.identities["acme"].runs == ["r1", "r2"]
    assert reg.identities["acme"].public_key != old_key
    assert (
        old_key not in reg.auth_conf.read_text()
        and reg.identities["acme"].public_key in reg.auth_conf.read_text()
    )

    assert main(["tenants", "--dir", d, "leave", "acme", "r1"]) == 0
    assert main(["tenants", "--dir", d, "list"]) == 0
    assert "acme" in capsys.readouterr().out
    assert main(["tenants", "--dir", d, "remove", "acme"]) == 0
    reg = TenantRegistry(d)
    assert "acme" not in reg.identities and not reg.creds_path("acme").exists() and not reg.api_keys
    assert main(["tenants", "--dir", d, "add", "trainer"]) == 2  # jetrl's own names are taken
    assert main(["tenants", "--dir", d, "remove", "nobody"]) == 2


def test_a_tenant_may_publish_only_its_own_subjects_of_its_runs(tmp_path: Path) -> None:
    reg = TenantRegistry(tmp_path)
    acme = reg.add("acme", ["r1"])
    perms = permissions(acme)
    allow = perms["publish"]["allow"]
    data = [a for a in allow if a.startswith("jetrl.")]
    assert sorted(data) == sorted(f"jetrl.r1.{k}.acme.*" for k in ("task", "rollout", "eval", "dlq"))
    view = view_stream_name("r1", "acme")
    api = [a for a in allow if not a.startswith("jetrl.")]
    assert api and all(view in a for a in api)  # the JetStream API on its own view only
    assert perms["subscribe"]["allow"] == ["_INBOX_acme.>"]
    # jetrl's parts: the trainer may publish steps, inference may not.
    reg.ensure_jetrl_identities()
    trainer = permissions(reg.identities["trainer"])["publish"]["allow"]
    inference = permissions(reg.identities["inference"])["publish"]["allow"]
    assert "jetrl.*.step" in trainer and "jetrl.*.step" not in inference
    assert "jetrl.*.generation.*.*" in inference and "jetrl.*.generation.*.*" not in trainer
