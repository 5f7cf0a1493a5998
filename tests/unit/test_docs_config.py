"""Every field of ManagerConfig and EngineConfig is documented in the table
of docs/configuration.md (engine fields as ``engine.<field>``)."""

import re
from dataclasses import fields
from pathlib import Path

from transfer.config import EngineConfig, ManagerConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def documented() -> set[str]:
    rows = [line.split("|")[1] for line in DOC.read_text().splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(r"`([\w.]+)`", row)}


def test_every_config_field_has_a_row():
    names = {f.name for f in fields(ManagerConfig)} | {f"engine.{f.name}" for f in fields(EngineConfig)}
    missing = sorted(names - documented())
    assert not missing, f"docs/configuration.md has no table row for {missing}"


def test_no_row_names_a_field_that_does_not_exist():
    names = {f.name for f in fields(ManagerConfig)} | {f"engine.{f.name}" for f in fields(EngineConfig)}
    unknown = sorted(documented() - names)
    assert not unknown, f"docs/configuration.md documents fields ManagerConfig/EngineConfig lack: {unknown}"
