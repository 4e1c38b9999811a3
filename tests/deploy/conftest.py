"""Fixtures of the deployment checks (Dockerfiles, Kubernetes manifests, the Grafana dashboard)."""

from __future__ import annotations

import argparse
import contextlib
import io
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace):
        super().__init__()
        self.namespace = namespace


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def parse_inferd() -> Callable[[list[str]], argparse.Namespace]:
    """parse_inferd(argv): argv (what follows `inferd`) parsed by inferd's own parser, the one `inferd.cli.main`
    builds, without running the command: its Namespace, or AssertionError with argparse's message (an unknown flag,
    a bad value). main() builds the parser inline, so its top-level parse_args is intercepted for the call."""
    from inferd import cli

    def parse(argv: list[str]) -> argparse.Namespace:
        original = argparse.ArgumentParser.parse_args

        def intercept(self, args=None, namespace=None):
            raise _Parsed(original(self, args, namespace))

        err = io.StringIO()
        argparse.ArgumentParser.parse_args = intercept
        try:
            with contextlib.redirect_stderr(err):
                cli.main(list(argv))
        except _Parsed as parsed:
            return parsed.namespace
        except SystemExit as e:
            raise AssertionError(f"`inferd {' '.join(argv)}` does not parse ({e.code}): {err.getvalue()}") from None
        finally:
            argparse.ArgumentParser.parse_args = original
        raise AssertionError(f"`inferd {' '.join(argv)}` ran instead of being parsed")

    return parse
