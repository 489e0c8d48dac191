"""The Prometheus endpoint (`serve --metrics-port`): plain HTTP, loopback by default."""

from __future__ import annotations

import logging

from prometheus_client import start_http_server

from inference_engine import metrics
from inference_engine.security.credentials import is_loopback

log = logging.getLogger(__name__)


class MetricsEndpoint:
    """Serves `inference_engine.metrics.REGISTRY` at http://HOST:PORT/metrics from a daemon thread."""

    def __init__(self, host: str, port: int):
        """
        Args:
            host: address to bind (a non-loopback one is logged as a WARNING: no TLS, no authentication).
            port: port to bind; 0 picks a free one.
        Raises:
            OSError: the address cannot be bound.
        """
        if not is_loopback(host):
            log.warning("metrics are served on %s:%d over plain HTTP without authentication", host, port)
        self._server, self._thread = start_http_server(port, addr=host, registry=metrics.REGISTRY)
        self.host = host
        self.port: int = self._server.server_port  # the bound port

    def close(self) -> None:
        """Stop serving and release the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
