"""`inferd gateway` refuses the flags that would do nothing there: the rollout targets (a rollout starts the new
version's local workers, and the gateway's workers run elsewhere). The real parser, in-process."""

from __future__ import annotations

import pytest

from inferd.cli import build_parser

ROLLOUT_ARGV = {"--rollout-min-requests": ["5"], "--rollout-min-seconds": ["1"],
                "--rollout-max-error-increase": ["0.1"], "--rollout-max-latency-ratio": ["2"], "--no-auto-promote": []}


def _argv(flag: str) -> list[str]:
    return [flag, *ROLLOUT_ARGV[flag]]


@pytest.mark.parametrize("flag", ROLLOUT_ARGV)
def test_gateway_refuses_rollout_flags_naming_why(flag, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["gateway", "--worker", "127.0.0.1:9000", *_argv(flag)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "inferd serve" in err and "no rollouts" in err, err


def test_serve_takes_rollout_flags():
    args = build_parser().parse_args(["serve", "--rollout-min-requests", "5", "--no-auto-promote"])
    assert args.rollout_min_requests == 5 and args.no_auto_promote


def test_gateway_parses_without_rollout_settings():
    args = build_parser().parse_args(["gateway", "--worker", "127.0.0.1:9000"])
    assert not any(name.startswith("rollout_") or name == "no_auto_promote" for name in vars(args))
