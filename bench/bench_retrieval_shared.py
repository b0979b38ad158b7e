#!/usr/bin/env python3
"""Retrieval shared by replicas: each replica's FAISS index, rebuilt from the PostgreSQL incidents
table when its revision moves (what logdx does), measured on two retrievers over one table.

Prints: the cold build (the seed knowledge base embedded once per replica), a search with nothing
changed (one `SELECT` of the revision plus the FAISS search), the first search on replica B after
replica A learned an incident from feedback (the revision moved: B re-embeds only the new incident),
and the same for an incident that was removed.

pgvector, the other option, is not installable on the project's machines (Debian's
`postgresql-15-pgvector` is not in their package source), so it is not measured here; see the README.

    python bench/bench_retrieval_shared.py [--pg postgresql://127.0.0.1:5432/test] [--searches 50]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "service"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from logdx.config import RetrievalSettings
from logdx.diagnose.retrieval import Retriever
from logdx.incidents import IncidentStore
from logdx.model import FailureContext
from logdx.store import open_db


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pg", default="postgresql://127.0.0.1:5432/test")
    ap.add_argument("--searches", type=int, default=50)
    args = ap.parse_args()
    import psycopg

    schema = "bench_rx_" + uuid.uuid4().hex[:8]
    with psycopg.connect(args.pg, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    url = f"{args.pg}?options=-csearch_path%3D{schema}"
    try:
        db_a, db_b = open_db(url), open_db(url)
        a, b = IncidentStore(db_a), IncidentStore(db_b)
        ra, rb = Retriever(a, RetrievalSettings()), Retriever(b, RetrievalSettings())
        ctx = FailureContext(root_text="RuntimeError: CUDA error: an illegal memory access was encountered",
                             root_masked="RuntimeError: CUDA error: an illegal memory access was encountered",
                             templates=["Exception raised from c10_cuda_check_implementation at <*>"], excerpt=[])
        cold_a = timed(ra.ensure_index)
        cold_b = timed(rb.ensure_index)
        print(f"{a.count()} incidents; cold build: replica A {cold_a:.0f} ms, replica B {cold_b:.0f} ms "
              "(the embedding model loads once per process)")
        rb.search(ctx)
        steady = [timed(lambda: rb.search(ctx)) for _ in range(args.searches)]
        print(f"search, nothing changed: median {statistics.median(steady):.1f} ms "
              f"(p95 {sorted(steady)[int(len(steady) * 0.95) - 1]:.1f} ms)")
        report = {"id": "rep-bench", "status": "failed", "category": "infrastructure", "failure_type": "cuda_error",
                  "root_cause": {"text": "RuntimeError: CUDA error: an illegal memory access at node-9"}}
        a.save_report(report)
        inc = a.feedback("rep-bench", "infrastructure", "cuda_error", note="bench")
        after_add = timed(lambda: rb.search(ctx))
        print(f"first search on B after A learned an incident: {after_add:.0f} ms "
              f"({rb.stats.embedded} embedded by B's rebuilds so far; reasons {rb.stats.reasons[-1:]})")
        a.remove(inc.id)
        after_remove = timed(lambda: rb.search(ctx))
        print(f"first search on B after A removed it: {after_remove:.0f} ms (nothing to embed)")
        db_a.close()
        db_b.close()
    finally:
        with psycopg.connect(args.pg, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")
    return 0


if __name__ == "__main__":
    sys.exit(main())
