"""The service's job runtime, apart from HTTP: one `JobManager` (`manager.py`: rows, diagnosis, reports,
reads) over a `Coordinator` (`coordinator.py`) that says where lines and sessions live (the spool files of
one process, `embedded.py` and `spool.py`, or the line bus and partition owners of a cluster, `cluster.py`,
`bus_ingest.py`, `partitions.py`); node streams (`nodestreams.py`), hang watch (`hangs.py`), retention
(`retention.py`), quotas and rate limits, metrics, readiness.

Nothing here imports FastAPI or Starlette: the faces (`logdx.api`, `logdx.agent`) call it and map its
results to wire models (`logdx.wire`). tests/test_layout.py checks it.
"""
