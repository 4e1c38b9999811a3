"""Tenants and keys: the keys file and `inferd keys` (create prints the key once, the file holds only its hash)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from inferd.gateway.tenants import AuthError, KeyStore, Tenant, create_key, revoke_key

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def test_create_authenticate_revoke(tmp_path):
    path = str(tmp_path / "keys.json")
    key, tenant = create_key(path, "acme", "interactive", rpm=60, tpm=10_000, max_concurrency=4, weight=2.0)
    assert tenant == Tenant("acme", "interactive", 60, 10_000, 4, 2.0)
    text = open(path).read()
    assert key not in text and key.split("-", 3)[3] not in text  # only the hash is stored (the secret may hold "-")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    store = KeyStore.load(path)
    assert store.authenticate(key) == tenant

    other, _ = create_key(path, "acme")  # a second key; the tenant keeps its settings
    assert KeyStore.load(path).authenticate(other).tpm == 10_000
    revoke_key(path, key.split("-")[2])  # by id
    store = KeyStore.load(path)
    with pytest.raises(AuthError, match="revoked"):
        store.authenticate(key)
    assert store.authenticate(other).name == "acme"


@pytest.mark.parametrize("bad", ["", "hello", "sk-inferd-zzzz", "sk-inferd-0123456789ab-short",
                                 "sk-inferd-0123456789ab-" + "a" * 43 + "x"])
def test_malformed_keys_are_refused(tmp_path, bad):
    with pytest.raises(AuthError, match="Malformed"):
        KeyStore().authenticate(bad)


def test_unknown_and_tampered_keys_are_refused(tmp_path):
    path = str(tmp_path / "keys.json")
    key, _ = create_key(path, "acme")
    store = KeyStore.load(path)
    tampered = key[:-1] + ("A" if key[-1] != "A" else "B")
    with pytest.raises(AuthError, match="Incorrect"):
        store.authenticate(tampered)
    unknown = "sk-inferd-000000000000-" + key.split("-", 3)[3]
    with pytest.raises(AuthError, match="Incorrect"):
        store.authenticate(unknown)


def test_invalid_files_and_settings_are_errors(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        KeyStore.load(str(path))
    path.write_text(json.dumps({"tenants": {"x": {"tier": "platinum"}}}))
    with pytest.raises(ValueError, match="tier"):
        KeyStore.load(str(path))
    with pytest.raises(ValueError, match="tpm"):
        create_key(str(tmp_path / "k2.json"), "x", tpm=0)
    assert KeyStore.load(str(tmp_path / "missing.json")).keys == {}  # `keys create` starts from nothing
    with pytest.raises(ValueError, match="missing"):  # a server's reload: never an empty key set by accident
        KeyStore.load(str(tmp_path / "missing.json"), missing_ok=False)
    with pytest.raises(ValueError, match="cache_group"):
        create_key(str(tmp_path / "k3.json"), "x", cache_group="g" * 257)  # MAX_IDENTIFIER_CHARS


def test_the_cache_salt_is_the_tenants_or_its_groups(tmp_path):
    path = str(tmp_path / "keys.json")
    salts = {name: create_key(path, name, cache_group=group)[1].cache_salt
             for name, group in [("a", None), ("b", None), ("c", "g"), ("d", "g"), ("g", None)]}
    assert salts["c"] == salts["d"]  # one group: one salt
    assert len(set(salts.values())) == 4  # every other pair differs (a tenant named like a group too)
    # of fixed length, and no tenant or group name travels to the workers in it
    assert all(len(s) == 64 and set(s) <= set("0123456789abcdef") for s in salts.values())
    assert KeyStore.load(path).tenants["c"].cache_salt == salts["c"]  # the group is kept in the file


def _inferd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "inferd", *args], capture_output=True, text=True, env=ENV,
                          timeout=120)


@pytest.mark.timeout(180)
def test_keys_cli(tmp_path):
    path = str(tmp_path / "keys.json")
    created = _inferd("keys", "create", "--keys", path, "--tenant", "acme", "--tier", "batch", "--tpm", "5000",
                      "--cache-group", "acme-and-friends", "--adapters", "sql-v1,support")
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()
    assert key.startswith("sk-inferd-") and "\n" not in key  # stdout is the key alone (scripts capture it)
    assert KeyStore.load(path).authenticate(key).tier == "batch"
    assert KeyStore.load(path).authenticate(key).adapters == ("sql-v1", "support")
    listed = _inferd("keys", "list", "--keys", path)
    assert listed.returncode == 0 and "acme" in listed.stdout and "batch" in listed.stdout
    assert "acme-and-friends" in listed.stdout
    assert key not in listed.stdout and key.split("-")[2] in listed.stdout
    revoked = _inferd("keys", "revoke", "--keys", path, key)
    assert revoked.returncode == 0, revoked.stderr
    assert KeyStore.load(path).keys[key.split("-")[2]].revoked is not None
    missing = _inferd("keys", "revoke", "--keys", path, "nope")
    assert missing.returncode == 2 and "no key" in missing.stderr
    bad = _inferd("keys", "create", "--keys", path, "--tenant", "x", "--rpm", "-3")
    assert bad.returncode == 2 and "rpm" in bad.stderr


@pytest.mark.timeout(120)
def test_serve_refuses_a_public_address_without_keys(tmp_path, smollm2_gguf_path):
    out = _inferd("serve", "--host", "0.0.0.0", "--port", "0", "--model", smollm2_gguf_path)
    assert out.returncode == 2
    assert "without API keys" in out.stderr and "loopback" in out.stderr


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["anonymous", "default"])
def test_the_built_in_tenants_names_are_reserved(tmp_path, name, tiny_llama_dir):
    """A keys-file tenant named like a built-in one would share its quota counters and could be taken for it (a
    batch of a tenant named anonymous ran without its quota; one named default saw the --api-key operator's
    files): the keys file may not hold one, whoever writes it."""
    path = tmp_path / "keys.json"
    with pytest.raises(ValueError, match="reserved"):
        create_key(str(path), name)
    cli = _inferd("keys", "create", "--keys", str(path), "--tenant", name)
    assert cli.returncode == 2 and "reserved" in cli.stderr and not path.exists()
    create_key(str(path), "acme")
    data = json.loads(path.read_text())
    data["tenants"][name] = {"tier": "standard"}  # written by hand
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="reserved"):
        KeyStore.load(str(path))
    served = _inferd("serve", "--port", "0", "--model", str(tiny_llama_dir), "--echo", "--keys", str(path))
    assert served.returncode == 1 and "reserved" in served.stderr  # refused at start, with the reason
    data["tenants"].pop(name)
    data["tenants"]["acme"]["builtin"] = True  # nor may a file make its tenant a built-in one
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="acme"):
        KeyStore.load(str(path))


def test_stored_things_are_owned_by_identities_that_never_collide():
    from inferd.gateway.tenants import ANONYMOUS_TENANT, DEFAULT_TENANT

    assert (ANONYMOUS_TENANT.identity, DEFAULT_TENANT.identity) == ("builtin:anonymous", "builtin:default")
    # a keys-file tenant is never a built-in one, whatever its name (even one loaded before names were reserved)
    assert Tenant("anonymous").identity == "key:anonymous" != ANONYMOUS_TENANT.identity
    assert Tenant("anonymous").cache_salt != ANONYMOUS_TENANT.cache_salt


def test_a_tenant_uses_the_adapters_its_entry_lists(tmp_path):
    """Absent: none (another tenant's fine-tune is not a default); a list: those; "*": all. The server's own tenants
    (no keys file) use every adapter. The list survives the file."""
    from inferd.gateway.tenants import ANONYMOUS_TENANT

    path = str(tmp_path / "keys.json")
    create_key(path, "none")
    create_key(path, "some", adapters=["a"])
    create_key(path, "all", adapters=["*"])
    tenants = KeyStore.load(path).tenants
    assert [tenants["none"].may_use_adapter(n) for n in ("a", "b")] == [False, False]
    assert [tenants["some"].may_use_adapter(n) for n in ("a", "b")] == [True, False]
    assert [tenants["all"].may_use_adapter(n) for n in ("a", "b")] == [True, True]
    assert ANONYMOUS_TENANT.may_use_adapter("a")
    assert "adapters" not in json.load(open(path))["tenants"]["none"]
    with pytest.raises(ValueError, match="adapters"):
        create_key(path, "bad", adapters=[""])
