"""Shared fixtures, and the two lanes of the suite.

`make test-fast` runs the unit tests: no model loading, no subprocesses, no servers, nothing long
(under 30 CPU-seconds in all). Everything else is marked `integration` (subprocesses, servers, the real
models) or `slow` (long runs: a test over about 0.3 CPU-s, a module of whole-job scenarios), here by
module or in the module itself, and runs in `make test`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import pytest

from logdx.config import DEFAULT_DATA_DIR
from logdx.pipeline import Engine
from logdx.store import Database, open_db
from logdx.testing import Clock, rules_engine

TESTS = Path(__file__).resolve().parent

# Tests never touch the user's data directory (database, spools, index), subprocesses included;
# the converted model is the one `make install` left where a plain `diagnose` finds it (or where
# LOGDX_LLM__CACHE_DIR says): converted once per machine, read by every run.
os.environ.setdefault("LOGDX_LLM__CACHE_DIR", str(DEFAULT_DATA_DIR / "models"))
os.environ.setdefault("LOGDX_DATA_DIR", tempfile.mkdtemp(prefix="logdx-tests-"))

# Modules whose every test starts a subprocess or a server, or loads a real model.
_INTEGRATION_MODULES = {
    "test_api.py", "test_api_durability.py", "test_api_limits.py", "test_cli.py", "test_learning_loop.py",
    "test_retrieval.py", "test_run.py", "test_scenarios.py",
}
# Modules of whole-job scenarios, each test a generated job or a pipeline run of its own (0.2-1 CPU-s a
# test): `slow`, in `make test`. A long test elsewhere carries `@pytest.mark.slow` itself.
_SLOW_MODULES = {
    "test_rules_draft.py", "test_shortlist.py", "test_startup_caches.py", "test_stragglers.py", "test_timeouts.py",
    "test_untrusted.py", "test_web_view.py",
}
# Fixtures that start a server or load a model: a test that uses one is an integration test.
_INTEGRATION_FIXTURES = {"server", "chat", "converted", "scorer", "rx", "kube", "receiver", "pg_url"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in _INTEGRATION_MODULES or _INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
        if item.path.name in _SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


def _load_receiver() -> ModuleType:
    """tests/fixtures/run/receiver.py: a real webhook receiver and a fake Kubernetes API on loopback
    (one module, however many tests load it)."""
    name = "logdx_test_receiver"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, TESTS / "fixtures" / "run" / "receiver.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def receiver() -> ModuleType:
    """The receiver module: `receiver.Receiver()` (webhooks), `receiver.FakeKube(nodes=[...])`."""
    return _load_receiver()


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    d = open_db(tmp_path / "logdx.db")
    yield d
    d.close()


@pytest.fixture(scope="session")
def engine() -> Engine:
    """The pipeline, rules only (`logdx.testing.rules_engine`), shared by the tests that diagnose lines."""
    return rules_engine()


@pytest.fixture
def clock() -> Clock:
    return Clock()


# --- the servers a cluster runs on: PostgreSQL and NATS JetStream ------------------------------------
# Every project machine runs them on loopback; a test that needs one is skipped, saying why, only
# when it cannot be reached. TEST_POSTGRES_URL / TEST_NATS_URL point elsewhere.

POSTGRES_URL = os.environ.get("TEST_POSTGRES_URL", "postgresql://127.0.0.1:5432/test")
NATS_URL = os.environ.get("TEST_NATS_URL", "nats://127.0.0.1:4222")


def postgres_unreachable() -> str | None:
    try:
        import psycopg

        with psycopg.connect(POSTGRES_URL, connect_timeout=3):
            return None
    except Exception as e:
        return f"PostgreSQL at {POSTGRES_URL} unreachable: {type(e).__name__}: {str(e).strip()[:200]}"


def nats_unreachable() -> str | None:
    import socket
    from urllib.parse import urlparse

    u = urlparse(NATS_URL)
    try:
        with socket.create_connection((u.hostname or "127.0.0.1", u.port or 4222), timeout=3) as sock:
            sock.settimeout(3)
            info = sock.recv(4096)
        if b'"jetstream":true' not in info.replace(b" ", b""):
            return f"NATS at {NATS_URL} runs without JetStream (start it with -js)"
        return None
    except OSError as e:
        return f"NATS at {NATS_URL} unreachable: {e}"


@contextmanager
def postgres_schema() -> Iterator[str]:
    """A PostgreSQL URL whose every table lives in a schema of its own (dropped after); skips the test
    when PostgreSQL cannot be reached."""
    why = postgres_unreachable()
    if why:
        pytest.skip(why)
    import uuid

    import psycopg

    schema = "t_" + uuid.uuid4().hex[:12]
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    sep = "&" if "?" in POSTGRES_URL else "?"
    try:
        yield f"{POSTGRES_URL}{sep}options=-csearch_path%3D{schema}"
    finally:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A PostgreSQL URL whose every table lives in a schema of this test's own (dropped after)."""
    with postgres_schema() as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.integration)])
def backend_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """The store on each backend (SQLite, PostgreSQL): a module whose tests run on both overrides
    `db` with it."""
    if request.param == "sqlite":
        d = open_db(tmp_path / "logdx.db")
    else:
        d = open_db(request.getfixturevalue("pg_url"))
    yield d
    d.close()
