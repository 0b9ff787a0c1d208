"""The sweep's memory in Prefect is not emptied by a stranger's artifact (issue 27, finding 7):
any newer version under its key that is not cudamedic's state is passed over with a warning, the
newest readable state is used, and a state whose "before" could not be read is never saved (it
would forget every host the sweep did not check). Real Prefect: the tests' server."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from flows.fleet_state import read_document, sweep_state, sweep_state_key
from runbooks.core.prefect_api import call
from runbooks.core.settings import Settings

FINDING = {"code": "driver-not-loaded", "level": "drain", "message": "m"}


def _settings(tmp_path: Path, name: str) -> Settings:
    fleet = "t-" + hashlib.sha256(f"{tmp_path}{name}".encode()).hexdigest()[:12]
    return Settings(state_dir=tmp_path / "state", fleet=fleet)


def _plant(key: str, kind: str, data: object) -> None:
    call("POST", "/artifacts/", {"key": key, "type": kind, "data": data}, timeout=5.0)


def test_a_strangers_newer_version_does_not_empty_the_sweep_memory(
    prefect_api: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    s = _settings(tmp_path, "a")
    with sweep_state(s) as (before, save):
        assert before == {}
        save({"node01": {"k": FINDING}, "node02": {"k": FINDING}})
    key = sweep_state_key(s)
    _plant(key, "markdown", "# not a state")  # any type, any data, by anyone with API access
    _plant(key, "cudamedic-state", {"no": "hosts"})  # our type, not a state
    with caplog.at_level("WARNING"), sweep_state(s) as (before, save):
        assert set(before) == {"node01", "node02"}  # the newest readable state
        save({"node01": {}})  # a partial sweep: node02 not checked this time
    assert "2 newer version(s) are not a state" in caplog.text
    stored, passed = read_document(key, lambda d: isinstance(d, dict) and "hosts" in d)
    assert passed == 0 and set(stored["hosts"]) == {"node01", "node02"}


def test_a_state_whose_before_is_unreadable_is_never_saved(
    prefect_api: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    s = _settings(tmp_path, "b")
    key = sweep_state_key(s)
    _plant(key, "markdown", "junk")
    with caplog.at_level("WARNING"), sweep_state(s) as (before, save):
        assert before == {}
        save({"node01": {"k": FINDING}})
    assert "was not saved" in caplog.text
    stored, passed = read_document(key, lambda d: True)
    assert passed == 1 and stored is None  # no state of ours was written over it
