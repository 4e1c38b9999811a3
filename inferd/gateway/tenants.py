"""Tenants and their API keys: the keys file, and who a request's key belongs to.

The keys file (JSON, written by `inferd keys`) holds tenants (tier, limits, fairness weight, cache group) and keys.
A key is `sk-inferd-<id>-<secret>`: the id is public (it names the key in `keys list` and in logs), the secret is
32 random bytes. The file stores only the key's SHA-256 (a 256-bit random secret needs no slow hash), and a key is
checked by looking its id up and comparing the digests in constant time (hmac.compare_digest), so that timing tells
nothing of the secret. The server holds an immutable `KeyStore` snapshot and swaps it on reload (SIGHUP, or the
file changed).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import os
import re
import secrets
import tempfile
import time
from dataclasses import asdict, dataclass, field

from ..config import DEFAULT_TIER, MAX_IDENTIFIER_CHARS, TIERS
from .limits import TenantLimits

KEY_PREFIX = "sk-inferd-"
_KEY_RE = re.compile(r"^sk-inferd-([0-9a-f]{12})-([A-Za-z0-9_-]{43})$")
ANONYMOUS = "anonymous"  # the tenant of every request when the server has no keys (loopback only)
DEFAULT = "default"  # the tenant of the single --api-key
# the built-in tenants' names, which a keys file may not use: a keys-file tenant named like one would share its
# quota counters, and could be taken for it
RESERVED_NAMES = (ANONYMOUS, DEFAULT)


@dataclass(frozen=True)
class Tenant:
    name: str
    tier: str = DEFAULT_TIER
    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None
    weight: float = 1.0
    # tenants of the same cache group share cached prompt prefixes; without one a tenant shares with nobody
    cache_group: str | None = None
    # the free-form `grammar` kind of structured outputs (EBNF, whose matching cost the client controls: a 403
    # grammar_not_allowed when false); JSON schemas, regexes, choices and tools stay allowed
    allow_grammar: bool = True
    # the LoRA adapters it may use by name ("*": every one); absent: none, only the base model. Another tenant's
    # adapter is, to it, a model that does not exist (a 404, and absent from its /v1/models)
    adapters: tuple[str, ...] | None = None
    # one of the server's own tenants (ANONYMOUS_TENANT, DEFAULT_TENANT), never one of a keys file (from_dict
    # refuses the field): what tells them apart, whatever the names
    builtin: bool = field(default=False, repr=False)

    @property
    def identity(self) -> str:
        """Who owns what is stored (the Batch API's files and batches): "builtin:NAME" or "key:NAME", so that no
        keys-file tenant can ever be the owner of a built-in tenant's things."""
        return f"{'builtin' if self.builtin else 'key'}:{self.name}"

    @property
    def cache_salt(self) -> str:
        """The prefix cache's salt for this tenant's requests (inferd/engine/kv_cache.py hash_block_tokens): its
        cache group's, else its own. A digest: of fixed length whatever the name, and the workers (perhaps another
        operator's machines) learn no tenant or group names from it."""
        owner = f"group:{self.cache_group}" if self.cache_group else f"tenant:{self.identity}"
        return hashlib.sha256(owner.encode()).hexdigest()

    def __post_init__(self) -> None:
        if isinstance(self.adapters, list):  # as JSON gives it: kept as a tuple, so that a Tenant stays hashable
            object.__setattr__(self, "adapters", tuple(self.adapters))

    def may_use_adapter(self, name: str) -> bool:
        """The server's own tenants (no keys file) may use every adapter; a keys-file tenant those it lists."""
        if self.builtin:
            return True
        return self.adapters is not None and ("*" in self.adapters or name in self.adapters)

    @property
    def tier_rank(self) -> int:
        return TIERS.index(self.tier)

    @property
    def limits(self) -> TenantLimits:
        return TenantLimits(self.rpm, self.tpm, self.max_concurrency)

    def validate(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"tier must be one of {', '.join(TIERS)}, got {self.tier!r}")
        for name in ("rpm", "tpm", "max_concurrency"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer or absent, got {value!r}")
        if not isinstance(self.allow_grammar, bool):
            raise ValueError(f"allow_grammar must be true or false, got {self.allow_grammar!r}")
        if not (isinstance(self.weight, (int, float)) and self.weight > 0):
            raise ValueError(f"weight must be > 0, got {self.weight!r}")
        if not self.name or not isinstance(self.name, str):
            raise ValueError("a tenant needs a name")
        if not self.builtin and self.name in RESERVED_NAMES:
            raise ValueError(f"the tenant name {self.name!r} is reserved for the server's built-in tenant "
                             f"({', '.join(RESERVED_NAMES)} are): choose another name")
        if self.adapters is not None and (not isinstance(self.adapters, tuple) or len(self.adapters) > 4096 or not all(
                isinstance(a, str) and 0 < len(a) <= 128 for a in self.adapters)):
            raise ValueError(f"adapters must be a list of adapter names (or \"*\": all), got {self.adapters!r}")
        if self.cache_group is not None and (not isinstance(self.cache_group, str) or not self.cache_group
                                             or len(self.cache_group) > MAX_IDENTIFIER_CHARS):
            raise ValueError(f"cache_group must be a non-empty name of at most {MAX_IDENTIFIER_CHARS} characters, "
                             f"got {self.cache_group!r}")


@dataclass(frozen=True)
class KeyRecord:
    id: str
    tenant: str
    sha256: str
    created: float
    revoked: float | None = None


class AuthError(Exception):
    """Why a key is refused (a 401)."""


@dataclass(frozen=True)
class KeyStore:
    tenants: dict[str, Tenant] = field(default_factory=dict)
    keys: dict[str, KeyRecord] = field(default_factory=dict)  # by key id

    # ---- checking a key (the server) -----------------------------------------------------------------------
    def authenticate(self, key: str) -> Tenant:
        match = _KEY_RE.match(key)
        if match is None:
            raise AuthError("Malformed API key: inferd keys look like sk-inferd-<12 hex>-<43 characters>")
        record = self.keys.get(match.group(1))
        digest = hashlib.sha256(key.encode()).hexdigest()
        # compared even when the id is unknown, against a dummy, so both paths take the same time
        expected = record.sha256 if record is not None else "0" * 64
        if not hmac.compare_digest(digest, expected) or record is None:
            raise AuthError("Incorrect API key provided")
        if record.revoked is not None:
            raise AuthError(f"This API key ({record.id}) has been revoked")
        tenant = self.tenants.get(record.tenant)
        if tenant is None:
            raise AuthError(f"This API key's tenant {record.tenant!r} no longer exists")
        return tenant

    # ---- the file ----------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str, missing_ok: bool = True) -> KeyStore:
        """Raises ValueError with the reason when the file is not a valid keys file. A missing file is an empty store
        (`keys create` starts one) unless missing_ok is False: a server's keys file that vanished (even between a
        check and this read) must never become an empty key set."""
        try:
            with open(path) as f:
                data = json.load(f)
        except FileNotFoundError:
            if not missing_ok:
                raise ValueError(f"the keys file {path} is missing") from None
            return cls()
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read the keys file {path}: {e}") from None
        return cls.from_dict(data, path)

    @classmethod
    def from_dict(cls, data: dict, where: str = "keys file") -> KeyStore:
        try:
            tenants = {}
            for name, fields in data.get("tenants", {}).items():
                if not isinstance(fields, dict) or "builtin" in fields or "name" in fields:
                    raise ValueError(f"tenant {name!r}: its settings must be an object of {', '.join(_SETTINGS)}")
                tenants[name] = Tenant(name=name, **fields)
            for t in tenants.values():
                t.validate()
            keys = {k["id"]: KeyRecord(**k) for k in data.get("keys", [])}
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise ValueError(f"{where}: invalid content: {e}") from None
        return cls(tenants, keys)

    def to_dict(self) -> dict:
        # allow_grammar only when false: files without it stay readable by versions that do not know it
        # adapters only when set, as a list
        return {"tenants": {n: {k: list(v) if k == "adapters" else v for k, v in asdict(t).items()
                                if k in _SETTINGS and not (k == "allow_grammar" and v is True)
                                and not (k == "adapters" and v is None)}
                            for n, t in self.tenants.items()},
                "keys": [asdict(k) for k in self.keys.values()]}

    def save(self, path: str) -> None:
        """Atomically (write a temporary file, rename), readable by the owner only."""
        folder = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix=".keys-", dir=folder)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_dict(), f, indent=2)
                f.write("\n")
            os.chmod(tmp, 0o600)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


# a tenant's fields in the keys file
_SETTINGS = ("tier", "rpm", "tpm", "max_concurrency", "weight", "cache_group", "allow_grammar", "adapters")
ANONYMOUS_TENANT = Tenant(ANONYMOUS, builtin=True)
DEFAULT_TENANT = Tenant(DEFAULT, builtin=True)


def new_key() -> tuple[str, str]:
    """(key id, the whole key)."""
    key_id = secrets.token_hex(6)
    return key_id, f"{KEY_PREFIX}{key_id}-{secrets.token_urlsafe(32)}"


@contextlib.contextmanager
def locked(path: str):
    """An exclusive lock beside the keys file, so that two `inferd keys` commands do not lose each other's writes."""
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def create_key(path: str, tenant: str, tier: str | None = None, rpm: int | None = None, tpm: int | None = None,
               max_concurrency: int | None = None, weight: float | None = None,
               cache_group: str | None = None, allow_grammar: bool | None = None,
               adapters: list[str] | None = None) -> tuple[str, Tenant]:
    """Adds a key for tenant (created, or updated with the settings given) and returns (the key, the tenant)."""
    with locked(path):
        store = KeyStore.load(path)
        old = store.tenants.get(tenant)
        fields = {"name": tenant, **({k: getattr(old, k) for k in _SETTINGS} if old is not None else {})}
        for name, value in (("tier", tier), ("rpm", rpm), ("tpm", tpm), ("max_concurrency", max_concurrency),
                            ("weight", weight), ("cache_group", cache_group), ("allow_grammar", allow_grammar),
                            ("adapters", adapters)):
            if value is not None:
                fields[name] = value
        new_tenant = Tenant(**fields)
        new_tenant.validate()
        key_id, key = new_key()
        record = KeyRecord(key_id, tenant, hashlib.sha256(key.encode()).hexdigest(), time.time())
        KeyStore({**store.tenants, tenant: new_tenant}, {**store.keys, key_id: record}).save(path)
    return key, new_tenant


def revoke_key(path: str, key_or_id: str) -> KeyRecord:
    """Marks a key revoked (by its id or the whole key). KeyError when there is no such key."""
    match = _KEY_RE.match(key_or_id)
    key_id = match.group(1) if match else key_or_id
    with locked(path):
        store = KeyStore.load(path)
        record = store.keys.get(key_id)
        if record is None:
            raise KeyError(key_id)
        if record.revoked is None:
            record = KeyRecord(**{**asdict(record), "revoked": time.time()})
            KeyStore(store.tenants, {**store.keys, key_id: record}).save(path)
    return record


def file_signature(path: str) -> tuple | None:
    """What changes when the file is replaced or edited (inode, size, mtime), None when it is missing."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)
