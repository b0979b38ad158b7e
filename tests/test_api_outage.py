"""What a client gets when what the service stands on is down: a 503 with Retry-After and a code
that says which (the handlers `logdx.api.errors` installs), never a 500; and the notes a job's
reports carry when the line bus lost some of its lines."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient

from logdx.api.errors import CatchAllMiddleware, install_error_handlers
from logdx.bus.base import BusError, BusFull, BusUsage
from logdx.jobs.cluster import gap_note
from logdx.store_base import StoreError


def _app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(CatchAllMiddleware)

    @app.get("/store")
    def store() -> None:
        raise StoreError("couldn't get a connection after 1.00 sec")

    @app.get("/bus")
    def bus() -> None:
        raise BusError("not connected to NATS at nats://127.0.0.1:4222 (reconnecting)")

    @app.get("/full")
    def full() -> None:
        raise BusFull("the stream refuses records (maximum bytes exceeded)")

    @app.get("/bug")
    def bug() -> None:
        raise ZeroDivisionError

    return app


def test_an_outage_is_a_503_with_retry_after_and_a_bug_stays_a_500():
    with TestClient(_app(), raise_server_exceptions=False) as client:
        answers = {path: client.get(path) for path in ("/store", "/bus", "/full", "/bug")}
    codes = {path: (r.status_code, r.json()["error"]["code"]) for path, r in answers.items()}
    assert codes == {"/store": (503, "store_unavailable"), "/bus": (503, "bus_unavailable"),
                     "/full": (503, "bus_full"), "/bug": (500, "internal_error")}
    for path in ("/store", "/bus", "/full"):
        assert int(answers[path].headers["retry-after"]) >= 1
    assert int(answers["/full"].headers["retry-after"]) > int(answers["/bus"].headers["retry-after"])
    assert "retry-after" not in answers["/bug"].headers


def test_a_gap_note_says_how_many_lines_and_whether_more_may_be_missing():
    assert gap_note([]) == ""
    exact = [{"kind": "missing_records", "lines": 25, "detail": "1 record(s) ... gone"},
             {"kind": "unaccounted_lines", "lines": 30, "detail": "100 acknowledged, 45 reached"}]
    note = gap_note(exact)
    assert note.startswith("incomplete: 55 acknowledged line(s) never reached this diagnosis: 100 acknowledged")
    assert "perhaps more" not in note
    maybe = gap_note([{"kind": "stream_lost_records", "lines": None, "detail": "records 5..9 removed"}])
    assert maybe.startswith("incomplete: acknowledged lines may be missing: records 5..9 removed")
    assert "perhaps more" in gap_note(exact + [{"kind": "stream_reset", "lines": None, "detail": "replaced"}])


def test_the_room_left_in_the_stream():
    assert BusUsage(records=3, bytes=700, max_bytes=1000, first_seq=1, last_seq=3).free() == 300
    assert BusUsage(records=3, bytes=1200, max_bytes=1000, first_seq=1, last_seq=3).free() == 0
    assert BusUsage(records=0, bytes=0, max_bytes=0, first_seq=4, last_seq=3).free() is None
