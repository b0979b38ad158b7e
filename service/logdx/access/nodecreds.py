"""Node-bound credentials: a token that speaks for one node only, so that one compromised node (or anyone
holding a shared DaemonSet token) cannot make logdx drain another.

Two kinds, both giving a shipper bound to the node (`Principal.hosts` = that node):

- Derived tokens (any scheduler, `logdx.credentials`). The operator keeps one secret, `server.node_key`, on the
  logdx server only, and gives each node its own token, `logdx token node gpu-node-21` ->
  `logdx-node.gpu-node-21.<HMAC-SHA256(node_key, host)>`. On Slurm, a prolog or the node's image installs its token;
  on Kubernetes, one Secret per node (`logdx-node-<node>`) mounted by a per-node pod spec.
- Kubernetes service-account tokens (`server.kubernetes_node_tokens`). The DaemonSet's pods present their
  projected service-account token (audience `server.kubernetes_audience`); the server asks the API server's
  TokenReview who it is and which node its pod is bound to (the `authentication.kubernetes.io/node-name`
  extra of Kubernetes 1.30+, else the pod's `spec.nodeName`). Nothing is distributed: the kubelet issues and
  rotates the tokens. Answers are kept `_REVIEW_TTL_S` (a token is sent on every upload).
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any

from logdx.hosts import clean_hostname

__all__ = ["KubernetesNodeTokens"]

_REVIEW_TTL_S = 60.0
_MAX_REVIEWS = 10_000
_NODE_NAME = "authentication.kubernetes.io/node-name"
_POD_NAME = "authentication.kubernetes.io/pod-name"


class KubernetesNodeTokens:
    """Which node a pod's service-account token belongs to, as the API server's TokenReview says."""

    def __init__(self, api: str, token: str, audience: str) -> None:
        self.api, self.token, self.audience = api, token, audience
        self._clients: Any = None
        self._lock = threading.Lock()
        self._seen: dict[bytes, tuple[float, str | None]] = {}  # token digest -> (until, node or None)

    def node_of(self, token: str) -> str | None:
        """The node of the pod the token was issued to; None when the API server does not vouch for it."""
        key = hashlib.sha256(token.encode()).digest()
        now = time.monotonic()
        with self._lock:
            seen = self._seen.get(key)
        if seen is not None and seen[0] > now:
            return seen[1]
        try:
            node = self._review(token)
        except Exception:  # noqa: BLE001 - an API server that does not answer vouches for nobody
            node = None
        with self._lock:
            if len(self._seen) >= _MAX_REVIEWS:
                self._seen.clear()
            self._seen[key] = (now + _REVIEW_TTL_S, node)
        return node

    def _review(self, token: str) -> str | None:
        from kubernetes import client

        auth, core = self._api()
        review = auth.create_token_review(client.V1TokenReview(spec=client.V1TokenReviewSpec(
            token=token, audiences=[self.audience] if self.audience else None)), _request_timeout=10)
        status = review.status
        if status is None or not status.authenticated or status.user is None:
            return None
        if self.audience and self.audience not in (status.audiences or []):
            return None
        extra = status.user.extra or {}
        for name in extra.get(_NODE_NAME) or []:
            return clean_hostname(name)
        pods, user = extra.get(_POD_NAME) or [], status.user.username or ""
        parts = user.split(":")  # system:serviceaccount:<namespace>:<name>
        if not pods or len(parts) != 4 or parts[:2] != ["system", "serviceaccount"]:
            return None
        pod = core.read_namespaced_pod(pods[0], parts[2], _request_timeout=10)
        return clean_hostname(pod.spec.node_name) if pod.spec is not None else None

    def _api(self) -> tuple[Any, Any]:
        if self._clients is None:
            from kubernetes import client

            from logdx.act.actuators.kubernetes import api_client

            shared = api_client(self.api, self.token)
            self._clients = (client.AuthenticationV1Api(shared), client.CoreV1Api(shared))
        return self._clients
