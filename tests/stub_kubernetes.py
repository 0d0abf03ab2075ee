"""A stub Kubernetes API server: pods by namespace and label selector, listed and watched.

Just what `baton router --service-discovery` asks of the real one, over plain HTTP on
127.0.0.1: `GET /api/v1/namespaces/NS/pods?labelSelector=k=v,...` answers a PodList with a
resourceVersion; with `watch=true` it streams one JSON event per line (chunked, as the API server
does) for every change made after that version, until `timeoutSeconds` or shutdown. A kubeconfig
pointing at it lets the official client (and so the router) use it unchanged.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit


def pod(name: str, labels: dict[str, str], ip: str, ready: bool = True, namespace: str = "ns"):
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def _matches(labels: dict[str, str], selector: str) -> bool:
    wanted = [term.split("=", 1) for term in selector.split(",") if term]
    return all(labels.get(key) == value for key, value in wanted)


class StubKubernetes:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.version = 1
        self.pods: dict[tuple[str, str], dict] = {}
        self.watches: list[tuple[str, str, queue.Queue]] = []  # (namespace, selector, events)
        self.requests: list[str] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                stub.serve(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> StubKubernetes:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def kubeconfig(self, directory: Path) -> Path:
        """A kubeconfig for this server (JSON is YAML)."""
        path = directory / "kubeconfig"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "stub",
            "clusters": [{"name": "stub", "cluster": {"server": self.url}}],
            "users": [{"name": "stub", "user": {"token": "stub-token"}}],
            "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "stub"}}],
        }))  # fmt: skip
        return path

    # -- changes made by a test -----------------------------------------------------------------

    def put(self, pod_object: dict) -> None:
        meta = pod_object["metadata"]
        key = (meta["namespace"], meta["name"])
        self._change("MODIFIED" if key in self.pods else "ADDED", pod_object)

    def delete(self, name: str, namespace: str = "ns") -> None:
        self._change("DELETED", self.pods[(namespace, name)])

    def _change(self, kind: str, pod_object: dict) -> None:
        with self.lock:
            self.version += 1
            pod_object = json.loads(json.dumps(pod_object))
            pod_object["metadata"]["resourceVersion"] = str(self.version)
            meta = pod_object["metadata"]
            key = (meta["namespace"], meta["name"])
            if kind == "DELETED":
                del self.pods[key]
            else:
                self.pods[key] = pod_object
            for namespace, selector, events in self.watches:
                if namespace == meta["namespace"] and _matches(meta.get("labels", {}), selector):
                    events.put({"type": kind, "object": pod_object})

    # -- the API ------------------------------------------------------------------------------

    def serve(self, handler: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(handler.path)
        self.requests.append(handler.path)
        segments = parts.path.strip("/").split("/")
        if segments[:3] != ["api", "v1", "namespaces"] or segments[4:] != ["pods"]:
            handler.send_error(404)
            return
        namespace = segments[3]
        query = {key: values[0] for key, values in parse_qs(parts.query).items()}
        selector = query.get("labelSelector", "")
        if query.get("watch") in ("true", "1", "True"):
            self._watch(handler, namespace, selector, float(query.get("timeoutSeconds", 30)))
            return
        with self.lock:
            items = [
                p for (ns, _), p in self.pods.items()
                if ns == namespace and _matches(p["metadata"]["labels"], selector)
            ]  # fmt: skip
            body = json.dumps({
                "apiVersion": "v1", "kind": "PodList",
                "metadata": {"resourceVersion": str(self.version)}, "items": items,
            }).encode()  # fmt: skip
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def _watch(self, handler, namespace: str, selector: str, timeout_s: float) -> None:
        events: queue.Queue = queue.Queue()
        watch = (namespace, selector, events)
        with self.lock:
            self.watches.append(watch)
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                try:
                    event = events.get(timeout=0.1)
                except queue.Empty:
                    continue
                line = json.dumps(event).encode() + b"\n"
                handler.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                handler.wfile.flush()
            handler.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass  # the client went away
        finally:
            with self.lock:
                self.watches.remove(watch)
