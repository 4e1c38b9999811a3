"""The engine flags' one table (inferd/cli/engine_flags.py): every EngineConfig field has a flag or a reason to have
none, and every flagged setting reaches a worker that `inferd serve` starts as it was given, through the real parsers
of `inferd serve` and `inferd worker`."""

from __future__ import annotations

import dataclasses

import pytest

from inferd.cli import build_parser
from inferd.cli.engine_flags import ENGINE_FLAGS, FLAGLESS, Flag, engine_argv, engine_config
from inferd.cli.serve import worker_args
from inferd.cli.types import parse_bytes, positive_float, positive_int, tier_shares_arg
from inferd.config import EngineConfig

MODEL_PATH = "/models/served"  # what serve resolved --model to: the path its workers load


def other_value(f: Flag):
    """A value of f's field other than its default, that f's flag can carry."""
    if f.switch:
        return not f.default
    if f.choices is not None:
        return next(c for c in f.choices if c != f.default)
    if f.parse in (int, positive_int):
        return (f.default or 0) + 3
    if f.parse in (float, positive_float):
        return f.default * 0.5 if f.default else 0.5
    if f.parse is parse_bytes:
        return (f.default or 1 << 30) * 3
    if f.parse is tier_shares_arg:
        return "interactive=50,standard=30,batch=20"
    if f.parse is None:
        return f"{f.default}-other" if f.default else "/models/other"
    raise AssertionError(f"{f.flag}: no sample value for its type {f.parse!r}; add one to other_value")


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_every_engine_config_field_has_a_flag_or_a_reason_to_have_none():
    fields = [f.name for f in dataclasses.fields(EngineConfig)]
    flagged = [f.field for f in ENGINE_FLAGS]
    assert len(flagged) == len(set(flagged)), "a field with two rows"
    assert len({f.flag for f in ENGINE_FLAGS}) == len(ENGINE_FLAGS), "two rows with one flag"
    assert not set(flagged) & set(FLAGLESS), "a field both flagged and flagless"
    missing = [name for name in fields if name not in flagged and name not in FLAGLESS]
    assert not missing, f"EngineConfig fields with neither a row in ENGINE_FLAGS nor a reason in FLAGLESS: {missing}"
    unknown = sorted((set(flagged) | set(FLAGLESS)) - set(fields))
    assert not unknown, f"rows for fields EngineConfig does not have: {unknown}"
    assert all(reason.strip() for reason in FLAGLESS.values())


def configs() -> list[tuple[str, EngineConfig]]:
    """Each flagged field alone at a value other than its default, then all of them at once."""
    values = {f.field: other_value(f) for f in ENGINE_FLAGS}
    out = [(name, EngineConfig(**{name: value})) for name, value in values.items()]
    return out + [("all", EngineConfig(**values))]


@pytest.mark.parametrize("name, config", configs(), ids=[name for name, _ in configs()])
def test_a_setting_reaches_serves_workers_as_given(name, config):
    argv = engine_argv(config)
    for command in ("serve", "generate x", "chat", "worker"):  # every command that runs an engine parses it alike
        assert engine_config(parse(*command.split(), *argv)) == config, command
    served = parse("serve", *argv)
    forwarded = worker_args(served, MODEL_PATH)  # what `inferd serve` starts each `inferd worker` with
    worker = engine_config(parse("worker", *forwarded))
    assert worker == dataclasses.replace(config, model=MODEL_PATH)
    assert worker == dataclasses.replace(engine_config(served), model=MODEL_PATH)


def test_defaults_are_not_forwarded():
    assert engine_argv(EngineConfig()) == []
    assert worker_args(parse("serve"), MODEL_PATH) == ["--heartbeat-interval", "0.5", "--model", MODEL_PATH]
