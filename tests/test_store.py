"""The shared SQLite layer: WAL, thread sharing, per-component versioned migrations."""

from __future__ import annotations

import sqlite3
import threading

import pytest

from logdx.store import Database, MigrationError, migrate, open_db, schema_version

JOBS_V1 = "CREATE TABLE jobs (id TEXT PRIMARY KEY, state TEXT NOT NULL)"
JOBS_V2 = "ALTER TABLE jobs ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0; CREATE INDEX jobs_state ON jobs(state)"
ALERTS_V1 = "CREATE TABLE alerts (id INTEGER PRIMARY KEY, job_id TEXT, sent_at REAL)"


@pytest.fixture
def db(tmp_path):
    d = open_db(tmp_path / "state" / "logdx.db")  # parent dir is created
    yield d
    d.close()


def tables(db: Database) -> set[str]:
    return {r[0] for r in db.query("SELECT name FROM sqlite_master WHERE type = 'table'")}


def test_file_db_uses_wal_and_creates_parent_dir(db, tmp_path):
    assert (tmp_path / "state" / "logdx.db").exists()
    assert db.journal_mode() == "wal"


def test_migrations_apply_in_order_and_are_recorded(db):
    assert migrate(db, "jobs", [JOBS_V1, JOBS_V2]) == 2
    cols = {r["name"] for r in db.query("PRAGMA table_info(jobs)")}
    assert cols == {"id", "state", "attempts"}
    rows = db.query("SELECT component, version FROM schema_versions ORDER BY version")
    assert [(r[0], r[1]) for r in rows] == [("jobs", 1), ("jobs", 2)]


def test_migrate_is_idempotent_and_appends_only_new_versions(db):
    migrate(db, "jobs", [JOBS_V1])
    db.execute("INSERT INTO jobs(id, state) VALUES ('a', 'failed')")
    assert migrate(db, "jobs", [JOBS_V1]) == 1  # nothing re-run: the row survives
    assert migrate(db, "jobs", [JOBS_V1, JOBS_V2]) == 2
    row = db.query("SELECT id, state, attempts FROM jobs")[0]
    assert tuple(row) == ("a", "failed", 0)


def test_components_evolve_independently(db):
    migrate(db, "jobs", [JOBS_V1, JOBS_V2])
    migrate(db, "alerts", [ALERTS_V1])
    assert schema_version(db, "jobs") == 2
    assert schema_version(db, "alerts") == 1
    assert schema_version(db, "nobody") == 0
    # A new component version does not touch the other component.
    migrate(db, "alerts", [ALERTS_V1, "ALTER TABLE alerts ADD COLUMN channel TEXT"])
    assert schema_version(db, "jobs") == 2 and schema_version(db, "alerts") == 2


def test_failed_migration_rolls_back_to_previous_version(db):
    bad = "CREATE TABLE half_done (x INTEGER); INSERT INTO no_such_table VALUES (1)"
    with pytest.raises(MigrationError, match="jobs migration 2 failed"):
        migrate(db, "jobs", [JOBS_V1, bad])
    assert schema_version(db, "jobs") == 1
    assert "half_done" not in tables(db)  # the whole migration, not only its failing statement


def test_editing_an_applied_migration_is_detected(db):
    migrate(db, "jobs", [JOBS_V1])
    # Re-indenting is fine ...
    assert migrate(db, "jobs", ["  CREATE TABLE jobs (id TEXT PRIMARY KEY,\n   state TEXT NOT NULL)"]) == 1
    # ... changing the statement is not.
    with pytest.raises(MigrationError, match="changed after it was applied"):
        migrate(db, "jobs", ["CREATE TABLE jobs (id TEXT PRIMARY KEY, state TEXT)"])


def test_database_from_a_newer_version_is_refused(db):
    migrate(db, "jobs", [JOBS_V1, JOBS_V2])
    with pytest.raises(MigrationError, match="newer than this logdx knows"):
        migrate(db, "jobs", [JOBS_V1])


def test_triggers_and_multiple_statements_in_one_migration(db):
    migrate(db, "counter", [
        """
        CREATE TABLE items (id INTEGER PRIMARY KEY, name TEXT);
        CREATE TABLE counter (n INTEGER NOT NULL);
        INSERT INTO counter VALUES (0);
        CREATE TRIGGER items_count AFTER INSERT ON items BEGIN
            UPDATE counter SET n = n + 1;
            UPDATE counter SET n = n + 0;  -- a second statement inside the trigger body
        END;
        """
    ])
    db.execute("INSERT INTO items(name) VALUES ('a; b')")
    db.execute("INSERT INTO items(name) VALUES ('c')")
    assert db.query_value("SELECT n FROM counter") == 2


def test_bad_component_name_rejected(db):
    with pytest.raises(ValueError):
        migrate(db, "jobs; DROP TABLE x", [JOBS_V1])


def test_transaction_commits_or_rolls_back(db):
    migrate(db, "jobs", [JOBS_V1])
    with db.transaction() as conn:
        conn.execute("INSERT INTO jobs VALUES ('ok', 'done')")
    with pytest.raises(RuntimeError), db.transaction() as conn:
        conn.execute("INSERT INTO jobs VALUES ('lost', 'done')")
        raise RuntimeError("boom")
    assert [r[0] for r in db.query("SELECT id FROM jobs")] == ["ok"]


def test_one_connection_shared_by_threads(db):
    migrate(db, "jobs", [JOBS_V1])
    errors: list[BaseException] = []

    def writer(t: int) -> None:
        try:
            for i in range(50):
                with db.transaction() as conn:
                    conn.execute("INSERT INTO jobs VALUES (?, 'x')", (f"{t}-{i}",))
                db.query("SELECT COUNT(*) FROM jobs")
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert db.query_value("SELECT COUNT(*) FROM jobs") == 400


def test_two_processes_worth_of_connections_share_versions(tmp_path):
    path = tmp_path / "shared.db"
    a, b = open_db(path), open_db(path)
    try:
        migrate(a, "jobs", [JOBS_V1])
        assert migrate(b, "jobs", [JOBS_V1, JOBS_V2]) == 2
        assert schema_version(a, "jobs") == 2
        a.execute("INSERT INTO jobs(id, state) VALUES ('x', 'y')")
        assert b.query_value("SELECT attempts FROM jobs WHERE id = 'x'") == 0
    finally:
        a.close()
        b.close()


def test_bare_sqlite_connection_is_accepted(tmp_path):
    conn = sqlite3.connect(tmp_path / "bare.db", isolation_level=None)
    try:
        assert migrate(conn, "jobs", [JOBS_V1]) == 1
        assert schema_version(conn, "jobs") == 1
    finally:
        conn.close()
    with pytest.raises(MigrationError, match="isolation_level=None"):
        migrate(sqlite3.connect(":memory:"), "jobs", [JOBS_V1])


def test_in_memory_database(tmp_path):
    with open_db(":memory:") as d:
        assert migrate(d, "jobs", [JOBS_V1]) == 1
