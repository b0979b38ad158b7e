"""Kubernetes: cordon = PATCH the Node's `spec.unschedulable: true` (what `kubectl cordon` does),
with an annotation saying why (and `logdx.io/capsule`: the evidence capsule's sha256); with `actions.kubernetes.taint`, also the taint
`logdx.io/failure=<failure_type>:NoSchedule`; uncordon undoes all three. Avoid (a node graded `avoid`) = the
taint `logdx.io/avoid=<family>:PreferNoSchedule` (the scheduler places pods elsewhere when it can) with an
annotation saying why; unavoid removes both. Cordon and uncordon leave the avoid taint alone. The API server is
`actions.kubernetes.api` with `actions.kubernetes.token` when set, else the in-cluster service account,
else `~/.kube/config`. Node names reach the API path only as validated `NodeName`s."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from logdx.act.actuators.base import NodeName, require_node
from logdx.act.report import Report
from logdx.settings_base import Section

TAINT_KEY = "logdx.io/failure"
ANNOTATION_KEY = "logdx.io/cordon-reason"
CAPSULE_KEY = "logdx.io/capsule"  # the sha256 of the evidence capsule written before the cordon
AVOID_TAINT_KEY = "logdx.io/avoid"
AVOID_EFFECT = "PreferNoSchedule"
AVOID_ANNOTATION_KEY = "logdx.io/avoid-reason"
KUBE_TIMEOUT_S = 30.0


class KubernetesSettings(Section):
    """How the Kubernetes actuator reaches the API server and marks a node."""

    taint: bool = Field(False, description="also taint a cordoned node logdx.io/failure=<failure_type>:NoSchedule")
    api: str = Field("", description="API server URL; empty: in-cluster service account, else ~/.kube/config")
    token: str = Field("", description="bearer token for `api` (LOGDX_ACTIONS__KUBERNETES__TOKEN)")
    job_pods: str = Field("job-name={job}", description="with actions.ask_scheduler: the label selector of a job's "
                          "pods ({job}: the logdx job's name); their spec.nodeName are the job's nodes")
    namespace: str = Field("", description="with actions.ask_scheduler: the namespace of the job's pods (empty: all)")

    moved_here = {"kube_taint": "taint", "kube_api": "api", "kube_token": "token"}


class KubernetesActuator:
    name = "kubernetes"
    Settings = KubernetesSettings

    def __init__(self, settings: KubernetesSettings) -> None:
        self.settings = settings
        self._api: Any = None  # kubernetes.client.CoreV1Api, built on first use

    def describe(self, node: NodeName, job_id: str, report: Report, *, capsule: str = "") -> str:
        what = f"PATCH node {node}: spec.unschedulable=true"
        if capsule:
            what += f", annotation {CAPSULE_KEY}=sha256:{capsule}"
        if self.settings.taint:
            what += f", taint {TAINT_KEY}={report.failure_type}:NoSchedule"
        return what

    def _core_api(self) -> Any:
        if self._api is None:
            from kubernetes import client

            self._api = client.CoreV1Api(api_client(self.settings.api, self.settings.token))
        return self._api

    def cordon(self, node: NodeName, job_id: str, report: Report, *, capsule: str = "") -> str:
        failure = report.failure_type or "unknown"
        taint = self.settings.taint

        def patch_of(current: Any) -> dict[str, Any]:
            patch: dict[str, Any] = {
                "metadata": {"annotations": {ANNOTATION_KEY: f"logdx: {failure} in job {job_id}"[:250]}},
                "spec": {"unschedulable": True},
            }
            if capsule:
                patch["metadata"]["annotations"][CAPSULE_KEY] = f"sha256:{capsule}"
            if taint:
                taints = _other_taints(current)
                taints.append({"key": TAINT_KEY, "value": failure, "effect": "NoSchedule"})
                patch["spec"]["taints"] = taints
            return patch

        self._patch(require_node(node), patch_of)
        return f"patched node {node}: unschedulable" + (f", taint {TAINT_KEY}={failure}:NoSchedule" if taint else "") \
            + (f", annotation {CAPSULE_KEY}=sha256:{capsule}" if capsule else "")

    def describe_uncordon(self, node: NodeName) -> str:
        return f"PATCH node {node}: spec.unschedulable=false, without logdx's taint and annotation"

    def uncordon(self, node: NodeName) -> str:
        def patch_of(current: Any) -> dict[str, Any]:
            return {"metadata": {"annotations": {ANNOTATION_KEY: None, CAPSULE_KEY: None}},
                    "spec": {"unschedulable": False, "taints": _other_taints(current)}}

        self._patch(require_node(node), patch_of)
        return f"patched node {node}: schedulable"

    def describe_avoid(self, node: NodeName, family: str) -> str:
        return f"PATCH node {node}: taint {AVOID_TAINT_KEY}={family}:{AVOID_EFFECT}"

    def avoid(self, node: NodeName, family: str, reason: str) -> tuple[str, str]:
        def patch_of(current: Any) -> dict[str, Any]:
            taints = _other_taints(current, AVOID_TAINT_KEY)
            taints.append({"key": AVOID_TAINT_KEY, "value": family, "effect": AVOID_EFFECT})
            return {"metadata": {"annotations": {AVOID_ANNOTATION_KEY: f"logdx: {reason}"[:250]}},
                    "spec": {"taints": taints}}

        self._patch(require_node(node), patch_of)
        return f"patched node {node}: taint {AVOID_TAINT_KEY}={family}:{AVOID_EFFECT}", ""

    def describe_unavoid(self, node: NodeName, undo: str) -> str:
        return f"PATCH node {node}: without the taint {AVOID_TAINT_KEY} and its annotation"

    def unavoid(self, node: NodeName, undo: str) -> str:
        def patch_of(current: Any) -> dict[str, Any]:
            return {"metadata": {"annotations": {AVOID_ANNOTATION_KEY: None}},
                    "spec": {"taints": _other_taints(current, AVOID_TAINT_KEY)}}

        self._patch(require_node(node), patch_of)
        return f"patched node {node}: no {AVOID_TAINT_KEY} taint"

    def _patch(self, node: NodeName, patch_of: Any) -> None:
        """Read the node, PATCH what `patch_of(node)` says, guarded by its resourceVersion (a node
        that changed under us is read again, twice at most)."""
        from kubernetes.client.exceptions import ApiException

        api = self._core_api()
        for attempt in range(3):
            current = api.read_node(node, _request_timeout=KUBE_TIMEOUT_S)  # 404: no such node
            patch = patch_of(current)
            patch["metadata"]["resourceVersion"] = current.metadata.resource_version
            try:
                api.patch_node(node, patch, _content_type="application/merge-patch+json",
                               _request_timeout=KUBE_TIMEOUT_S)
                return
            except ApiException as e:
                if e.status == 409 and attempt < 2:  # the node changed under us: read it again
                    continue
                raise
        raise RuntimeError("conflict patching node")  # pragma: no cover - the loop returns or raises


    def nodes_of_job(self, job_name: str) -> list[str] | None:
        """The nodes the job's pods (`job_pods`) are bound to."""
        from logdx.hosts import clean_hostname

        api, s = self._core_api(), self.settings
        selector = s.job_pods.replace("{job}", job_name)
        if s.namespace:
            pods = api.list_namespaced_pod(s.namespace, label_selector=selector, _request_timeout=KUBE_TIMEOUT_S)
        else:
            pods = api.list_pod_for_all_namespaces(label_selector=selector, _request_timeout=KUBE_TIMEOUT_S)
        nodes = sorted({h for p in pods.items if p.spec and (h := clean_hostname(p.spec.node_name))})
        return nodes or None


def api_client(api: str, token: str) -> Any:
    """A client of the API server `api` with bearer `token`; without `api`, the in-cluster service account, else
    ~/.kube/config (`kubernetes.client.ApiClient`)."""
    from kubernetes import client, config

    if api:
        cfg = client.Configuration()
        cfg.host = api.rstrip("/")
        if token:
            cfg.api_key = {"BearerToken": token}
            cfg.api_key_prefix = {"BearerToken": "Bearer"}
        return client.ApiClient(cfg)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def _other_taints(current: Any, key: str = TAINT_KEY) -> list[dict[str, Any]]:
    """The node's taints other than logdx's own `key`, as plain dicts."""
    own = (current.spec.taints or []) if current.spec else []
    taints = [t.to_dict() for t in own if t.key != key]
    return [{k: v for k, v in t.items() if v is not None} for t in taints]
