"""`jetrl gateway keys`: API keys for users who are not tenants, in the gateway's keys file
(hashes only), and the file `jetrl gateway RUN` takes."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from jetrl.deploy.cli import main
from jetrl.deploy.gateway_cmd import keys_file
from jetrl.deploy.tenants import TenantRegistry
from jetrl.producers.gateway import ApiKeys


def shown_key(out: str) -> str:
    return out.split("shown once): ")[1].split()[0]


def test_users_keys_are_added_listed_and_removed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "keys.json"
    assert main(["gateway", "keys", "add", "alice", "--rpm", "60", "--keys", str(path)]) == 0
    alice = shown_key(capsys.readouterr().out)
    assert (
        main(
            ["gateway", "keys", "add", "bob", "--tenant", "acme", "--max-in-flight", "2", "--keys", str(path)]
        )
        == 0
    )
    bob = shown_key(capsys.readouterr().out)
    text = path.read_text()
    assert alice not in text and bob not in text  # shown once, kept as hashes
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    keys = ApiKeys(path)
    a, b = keys.lookup(alice), keys.lookup(bob)
    assert a is not None and (a.user, a.tenant, a.rpm, a.max_in_flight) == ("alice", "default", 60, None)
    assert b is not None and (b.user, b.tenant, b.rpm, b.max_in_flight) == ("bob", "acme", None, 2)

    assert main(["gateway", "keys", "list", "--keys", str(path)]) == 0
    listed = capsys.readouterr().out
    assert "alice" in listed and "bob" in listed and alice not in listed
    assert main(["gateway", "keys", "remove", "alice", "--keys", str(path)]) == 0
    assert ApiKeys(path).lookup(alice) is None and ApiKeys(path).lookup(bob) is not None

    for argv in (
        ["remove", "alice"],  # gone already
        ["add", "a.b"],  # not a subject token
        ["add", "eve", "--tenant", "trainer"],  # jetrl's own
        ["add", "eve", "--rpm", "0"],
        ["frob"],
        ["add"],
    ):
        assert main(["gateway", "keys", *argv, "--keys", str(path)]) == 2, argv
    assert main(["gateway", "some-run", "extra"]) == 2
    assert json.loads(path.read_text())["keys"] and len(json.loads(path.read_text())["keys"]) == 1


def test_the_deployments_keys_file_holds_tenants_and_users_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = str(tmp_path / "t")
    reg = TenantRegistry(d)
    assert keys_file(None, reg) is None  # no tenants, no keys: served open, as before
    assert main(["gateway", "keys", "add", "carol", "--tenants-dir", d]) == 0
    carol = shown_key(capsys.readouterr().out)
    reg = TenantRegistry(d)
    assert keys_file(None, reg) == str(reg.keys_path) and keys_file("mine.json", reg) == "mine.json"
    assert main(["tenants", "--dir", d, "add", "acme", "--run", "r1", "--api-key", "--rpm", "5"]) == 0
    acme = shown_key(capsys.readouterr().out)
    assert main(["gateway", "keys", "add", "dave", "--tenant", "acme", "--tenants-dir", d]) == 0
    dave = shown_key(capsys.readouterr().out)
    keys = ApiKeys(TenantRegistry(d).keys_path)  # the registry's saves keep the users' keys
    assert keys.lookup(carol) is not None and keys.lookup(dave) is not None
    grant = keys.lookup(acme)
    assert grant is not None and (grant.tenant, grant.user, grant.rpm) == ("acme", None, 5)
    assert main(["tenants", "--dir", d, "list"]) == 0
    listed = capsys.readouterr().out
    assert "carol" in listed and "dave" in listed and "api keys 1" in listed  # acme's own: one
    # A tenant removed takes the keys of the users served on its subjects with it.
    assert main(["tenants", "--dir", d, "remove", "acme"]) == 0
    keys = ApiKeys(TenantRegistry(d).keys_path)
    assert keys.lookup(acme) is None and keys.lookup(dave) is None and keys.lookup(carol) is not None
