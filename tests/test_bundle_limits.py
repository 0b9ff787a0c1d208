"""A bundle of many tiny files is read in linear time, and a directory bundle has the member cap
of a .tar.gz (issue 27, finding 8): 16,000 tiny files took `classify` 83 s, a 75 kB .tar.gz of
9,999 members 38 s (each container's facts sorted every name of the bundle)."""

from __future__ import annotations

import tarfile
import time
from pathlib import Path

import pytest

from runbooks.collect.bundle import MAX_TAR_MEMBERS
from runbooks.core.errors import InputError
from runbooks.diagnose.classify import classify_path


def _tiny_files(root: Path, n: int) -> Path:
    bundle = root / "bundle"
    (bundle / "containers").mkdir(parents=True)
    for i in range(n):
        (bundle / "containers" / f"c{i}.log").write_text("x\n")
    return bundle


def test_many_tiny_files_are_classified_in_linear_time(tmp_path: Path) -> None:
    state = tmp_path / "state"
    classify_path(_tiny_files(tmp_path / "warm", 10), state_dir=state)  # tables, matchers
    bundle = _tiny_files(tmp_path, MAX_TAR_MEMBERS - 3)  # with its two folders in a tar
    start = time.monotonic()
    classify_path(bundle, state_dir=state)
    took_dir = time.monotonic() - start
    packed = tmp_path / "bundle.tar.gz"
    with tarfile.open(packed, "w:gz") as tar:
        tar.add(bundle, arcname="bundle")
    start = time.monotonic()
    classify_path(packed, state_dir=state)
    took_tar = time.monotonic() - start
    assert took_dir < 20 and took_tar < 30, (took_dir, took_tar)  # was 67 s and more


def test_a_directory_bundle_past_the_member_cap_is_refused(tmp_path: Path) -> None:
    bundle = _tiny_files(tmp_path, MAX_TAR_MEMBERS + 1)
    with pytest.raises(InputError, match=f"more than {MAX_TAR_MEMBERS} entries"):
        classify_path(bundle, state_dir=tmp_path / "state")
