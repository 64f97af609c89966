"""The store fixtures of the conformance suite: ``store`` and ``stores`` are parametrised
over both kinds of store (tests/store/conformance.py)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.store.conformance import STORE_KINDS, Store, Stores


@pytest.fixture(params=STORE_KINDS)
def store_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def stores(request: pytest.FixtureRequest, store_kind: str, tmp_path: Path) -> Iterator[Stores]:
    """Opens empty stores of this test's kind; closes them after the test."""
    url = request.getfixturevalue("pg_url") if store_kind == "postgres" else None
    opener = Stores(store_kind, tmp_path, url)
    try:
        yield opener
    finally:
        opener.close()


@pytest.fixture
def store(stores: Stores) -> Store:
    """A fresh, empty store whose jitter comes from a seeded generator."""
    return stores.open(rng=random.Random(1234))
