"""``macpool dev test`` hands files to its workers in the order collected: the longest files go first."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest

from tests.conftest import LONGEST_FIRST, pytest_collection_modifyitems

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Item:
    nodeid: str


def test_every_file_named_longest_first_exists() -> None:
    missing = [path for path in LONGEST_FIRST if not (ROOT / path).is_file()]
    assert not missing, f"renamed or removed: {missing}"


def test_the_longest_files_come_first_and_every_file_stays_whole() -> None:
    first, second = LONGEST_FIRST[:2]
    ids = ["tests/a.py::t1", f"{second}::t1", "tests/a.py::t2", f"{first}::t1", "tests/b.py::t1",
           f"{second}::t2"]
    items = [Item(i) for i in ids]
    pytest_collection_modifyitems(cast(list[pytest.Item], items))
    assert [i.nodeid for i in items] == [
        f"{first}::t1", f"{second}::t1", f"{second}::t2",
        "tests/a.py::t1", "tests/a.py::t2", "tests/b.py::t1",
    ]
