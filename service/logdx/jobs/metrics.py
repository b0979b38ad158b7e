"""Prometheus metrics, on a registry of the app's own (so two apps in one process do not clash).

Counters and histograms are updated on the hot path; gauges that describe state (open jobs,
loaded sessions, templates, pending alerts) are computed when /metrics is scraped.

With `server.workers > 1` each worker process keeps its own numbers and /metrics shows the worker
that answered; run one worker per instance (and scale with instances) when exact numbers matter.
Replicas sharing a line bus label every series with `replica` (`server.replica_id`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)
_HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class _StateCollector(Collector):
    def __init__(self, read: Callable[[], dict[str, float | dict[str, float]]]) -> None:
        self._read = read

    def collect(self) -> Iterable[GaugeMetricFamily]:
        try:
            state = self._read()
        except Exception:  # noqa: BLE001 - a scrape must not fail because of one gauge
            return []
        out = []
        for name, value in state.items():
            doc, _, metric = name.partition("|")
            if isinstance(value, dict):
                label, _, mname = metric.partition(":")
                g = GaugeMetricFamily(mname, doc, labels=[label])
                for k, v in value.items():
                    g.add_metric([k], v)
            else:
                g = GaugeMetricFamily(metric, doc, value=value)
            out.append(g)
        return out


class _Labelled:
    """The registry's series, each with constant labels added (the replica's name)."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self.registry = registry
        self.labels = labels

    def collect(self) -> Iterable[Metric]:
        for family in self.registry.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                out.samples.append(sample._replace(labels={**sample.labels, **self.labels}))
            yield out


class Metrics:
    def __init__(self, replica: str = "") -> None:
        """`replica`: with several replicas, every series carries `replica="<name>"`."""
        self.const_labels = {"replica": replica} if replica else {}
        disable_created_metrics()  # no `*_created` series next to every counter
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.lines = Counter("logdx_ingest_lines_total", "Log lines accepted", ["format"], registry=r)
        self.bytes = Counter("logdx_ingest_bytes_total", "Request body bytes received (as sent)", ["format"],
                             registry=r)
        self.truncated = Counter("logdx_ingest_lines_truncated_total",
                                 "Lines longer than input.max_line_bytes, cut and marked", registry=r)
        self.skipped = Counter("logdx_ingest_records_skipped_total", "JSON records without a message field",
                               registry=r)
        self.rejected = Counter("logdx_ingest_rejected_total", "Ingest requests refused", ["reason"], registry=r)
        self.http = Counter("logdx_http_requests_total", "HTTP requests", ["method", "route", "status"], registry=r)
        self.http_latency = Histogram("logdx_http_request_duration_seconds", "HTTP request duration",
                                      ["method", "route"], buckets=_HTTP_BUCKETS, registry=r)
        self.stage = Histogram("logdx_stage_duration_seconds",
                               "Time per unit of work by stage (decode+parse, spool, feed: per chunk; "
                               "fsync: per request; diagnose, replay: per run)",
                               ["stage"], buckets=_STAGE_BUCKETS, registry=r)
        self.reports = Counter("logdx_reports_total", "Diagnoses made", ["kind", "status", "category"], registry=r)
        self.lost_gpu_hours = Counter("logdx_lost_gpu_hours_total", "GPU-hours failed jobs lost since their last checkpoint "
                                      "(each job once: its report's cost.lost_gpu_hours)", ["cause", "category"],
                                      registry=r)
        self.root_to_report = Histogram("logdx_root_cause_to_report_seconds",
                                        "From the first root-cause line's arrival to the first early diagnosis",
                                        buckets=_STAGE_BUCKETS, registry=r)
        self.alerts_enqueued = Counter("logdx_alerts_enqueued_total", "Alerts queued by outcome", ["outcome"],
                                       registry=r)
        self.alert_deliveries = Counter("logdx_alert_deliveries_total", "Alert delivery attempts",
                                        ["kind", "outcome"], registry=r)
        self.actions = Counter("logdx_actions_total", "Actions decided", ["action", "outcome"], registry=r)
        self.replayed_lines = Counter("logdx_spool_replayed_lines_total", "Lines replayed from spools", registry=r)
        self.refused = Counter("logdx_http_refused_total",
                               "Requests refused before routing: unknown method, Host, Origin, browser-simple POST",
                               ["reason"], registry=r)
        self.bus_gaps = Counter("logdx_bus_gaps_total",
                                "Records an owner found missing from the line bus, by kind (each is logged, and "
                                "stored with the job: GET /v1/jobs/{id} bus_gaps)", ["kind"], registry=r)
        self.bus_lost_lines = Counter("logdx_bus_lost_lines_total",
                                      "Acknowledged lines that never reached their diagnosis (the bus lost them)",
                                      registry=r)
        self.retention_deleted = Counter("logdx_retention_deleted_total",
                                         "What the retention sweep deleted (jobs, reports, alerts, audit rows)",
                                         ["kind"], registry=r)

    def add_state(self, read: Callable[[], dict[str, float | dict[str, float]]]) -> None:
        """Gauges computed at scrape time. Keys: "help|name" or "help|label:name" for a dict."""
        self.registry.register(_StateCollector(read))

    def render(self) -> bytes:
        if self.const_labels:
            return generate_latest(_Labelled(self.registry, self.const_labels))
        return generate_latest(self.registry)
