"""Keys and secrets from flags, files and the environment (never echoed), and the loopback test that decides
whether a server may run without them."""

from __future__ import annotations

import argparse
import ipaddress
import os

from ..config import REDIS_PASSWORD_ENV, WORKER_SECRET_ENV


def read_key(args: argparse.Namespace, name: str, env: str) -> str | None:
    """--NAME, else --NAME-file, else $ENV (unset: None). ValueError on an empty flag, file or variable (a key that
    any empty bearer would match, or a setting gone wrong that would silently turn the key off), both the flag and
    the file, or an unreadable file."""
    flag = name.replace("_", "-")
    value, path = getattr(args, name), getattr(args, name + "_file")
    if value is not None and path is not None:
        raise ValueError(f"give --{flag} or --{flag}-file, not both")
    if value is not None:
        if not value.strip():
            raise ValueError(f"--{flag} is empty: give a key, or leave the flag out")
        return value.strip()  # the bearer token is compared stripped
    if path is not None:
        try:
            with open(path) as f:
                value = f.read().strip()
        except OSError as e:
            raise ValueError(f"cannot read --{flag}-file: {e}") from None
        if not value:
            raise ValueError(f"--{flag}-file {path} is empty")
        return value
    value = os.environ.get(env)
    if value is not None and not value.strip():
        raise ValueError(f"${env} is set but empty: give a key, or unset it")
    return value.strip() if value is not None else None


def read_worker_secret(args: argparse.Namespace) -> str:
    """--worker-secret, else --worker-secret-file, else $INFERD_WORKER_SECRET, else "" (none); ValueError as
    read_key."""
    return read_key(args, "worker_secret", WORKER_SECRET_ENV) or ""


def add_redis_password(args: argparse.Namespace) -> None:
    """$INFERD_REDIS_PASSWORD (a Redis with requirepass, e.g. from a Kubernetes Secret) goes into the --redis and
    --register URLs that carry no password: it stays out of argv, and every Redis client inferd makes gets it."""
    password = os.environ.get(REDIS_PASSWORD_ENV)
    if not password:
        return
    for name in ("redis", "register"):
        url = getattr(args, name, None)
        if url:
            setattr(args, name, redis_url_with_password(url, password))


def redis_url_with_password(url: str, password: str) -> str:
    """redis[s]://[USER@]HOST... -> redis[s]://[USER]:PASSWORD@HOST... (quoted; redis-py unquotes it). A URL that
    has a password, or of another scheme, is returned as it is."""
    from urllib.parse import quote, urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss") or parts.password is not None:
        return url
    user, _, hostport = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{hostport}"))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
