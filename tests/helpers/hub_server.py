"""A local Hugging Face Hub for the tests: stdlib ``http.server`` in a thread, on a free port.

It speaks the part of the Hub protocol that ``huggingface_hub`` and ``transformers`` use for
what peakprobe does: a repo's refs (``/api/models/R/refs``), model info, the tree of a revision
with LFS hashes (``/api/models/R/tree/REV``), and file resolution at a branch or commit
(``/R/resolve/REV/PATH``): ``X-Repo-Commit`` and ``ETag`` on every file; weight files answered
as LFS files are, by a redirect to another host name of this server (``localhost`` for
``127.0.0.1``, as the Hub's CDN is another host) carrying ``X-Linked-Etag`` / ``X-Linked-Size``;
``Range`` requests answered with 206. Errors carry the Hub's ``X-Error-Code`` headers
(``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``, ``GatedRepo``).

Faults are planted per path: an HTTP status (e.g. 503) the next N times, or a connection that
sends half a file and is then reset or closed. Every request is logged in ``requests`` as
(method, path, status), status -1 for a reset and -2 for a cut connection.
"""

from __future__ import annotations

import hashlib
import json
import socket
import struct
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin")


@dataclass
class Repo:
    branches: dict[str, str] = field(default_factory=dict)  # branch -> commit sha
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> {path: bytes}
    gated: bool = False


@dataclass
class Fault:
    """``kind``: an HTTP status code, "reset" (half the body, then a TCP reset) or "cut" (half
    the body, then the connection closed, which huggingface_hub resumes with a Range); ``method``
    "GET" or "HEAD"; it fires the next ``times`` requests whose path ends with ``path``."""

    path: str
    kind: int | str
    method: str = "GET"
    times: int = 1


class HubServer:
    """The local hub: ``add_revision`` publishes a folder as a branch; ``url`` is HF_ENDPOINT."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.faults: list[Fault] = []
        self.requests: list[tuple[str, str, int]] = []  # (method, path, status)
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.cdn = f"http://localhost:{self.port}"  # another host name: a CDN to huggingface_hub
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> HubServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def add_revision(self, repo_id: str, branch: str, folder: Path, *, gated: bool = False) -> str:
        """Publish every file under ``folder`` as ``branch`` of ``repo_id``; returns its commit."""
        files = {p.relative_to(folder).as_posix(): p.read_bytes()
                 for p in sorted(folder.rglob("*")) if p.is_file()}
        digest = hashlib.sha1()
        for name, data in files.items():
            digest.update(name.encode() + hashlib.sha256(data).digest())
        sha = digest.hexdigest()
        repo = self.repos.setdefault(repo_id, Repo())
        repo.gated |= gated
        repo.commits[sha] = files
        repo.branches[branch] = sha
        return sha

    def fail(self, path: str, kind: int | str, method: str = "GET", times: int = 1) -> None:
        with self.lock:
            self.faults.append(Fault(path, kind, method, times))

    def take_fault(self, method: str, path: str) -> Fault | None:
        with self.lock:
            for fault in self.faults:
                if fault.method == method and fault.times > 0 and path.endswith(fault.path):
                    fault.times -= 1
                    return fault
        return None

    def blob(self, sha256: str) -> bytes | None:
        for repo in self.repos.values():
            for files in repo.commits.values():
                for data in files.values():
                    if hashlib.sha256(data).hexdigest() == sha256:
                        return data
        return None


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubHandler(BaseHTTPRequestHandler):
    """Answers for the hub ``hub`` (set on a subclass by ``_handler``)."""

    hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:  # noqa: N802 (the http.server API)
        self._serve(body=False)

    def do_GET(self) -> None:  # noqa: N802
        self._serve(body=True)

    # -- answers --------------------------------------------------------------------------
    def _send(self, status: int, body: bytes = b"", headers: dict | None = None,
              send_body: bool = True) -> None:
        self.hub.requests.append((self.command, self.path, status))
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, str(v))
        if "Content-Length" not in (headers or {}):
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body and body:
            self.wfile.write(body)

    def _json(self, obj, send_body: bool, headers: dict | None = None) -> None:
        body = json.dumps(obj).encode()
        self._send(200, body, {"Content-Type": "application/json", **(headers or {})}, send_body)

    def _error(self, status: int, code: str, message: str, send_body: bool, extra: dict | None = None):
        body = json.dumps({"error": message}).encode()
        self._send(status, body, {"Content-Type": "application/json", "X-Error-Code": code,
                                  "X-Error-Message": message, **(extra or {})}, send_body)

    def _broken(self, headers: dict, data: bytes, reset: bool) -> None:
        """Send the headers and half the body, then reset (RST) or close the connection."""
        self.hub.requests.append((self.command, self.path, -1 if reset else -2))
        self.send_response(200)
        for k, v in headers.items():
            self.send_header(k, str(v))
        self.end_headers()
        self.wfile.write(data[: len(data) // 2])
        self.wfile.flush()
        if reset:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            self.connection.shutdown(socket.SHUT_RDWR)
        self.connection.close()
        self.close_connection = True

    # -- routing --------------------------------------------------------------------------
    def _serve(self, body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        fault = self.hub.take_fault(self.command, path)
        if fault is not None and fault.kind not in ("reset", "cut"):
            return self._error(int(fault.kind), "", "Service Unavailable (planted)", body)
        if path in ("", "/"):
            return self._send(200, b"", {}, body)
        if path.startswith("/cdn/"):
            return self._cdn(path.split("/")[2], body, fault)
        api = path.startswith("/api/models/")
        parts = path.removeprefix("/api/models/" if api else "/").split("/")
        repo_id = "/".join(parts[:2])
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            return self._error(401, "RepoNotFound", "Repository not found", body)
        if repo.gated and not self.headers.get("Authorization"):
            return self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must "
                               "have access to it and be authenticated to access it. Please log in.", body)
        rest = parts[2:]
        if api:
            return self._api(repo_id, repo, rest, body)
        if len(rest) >= 3 and rest[0] == "resolve":
            return self._resolve(repo, rest[1], "/".join(rest[2:]), body, fault)
        return self._error(404, "", "Not found", body)

    def _commit(self, repo: Repo, revision: str, body: bool) -> str | None:
        sha = repo.branches.get(revision) or (revision if revision in repo.commits else None)
        if sha is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", body)
        return sha

    def _api(self, repo_id: str, repo: Repo, rest: list[str], body: bool) -> None:
        if rest == ["refs"]:
            branches = [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": s}
                        for b, s in sorted(repo.branches.items())]
            return self._json({"branches": branches, "converts": [], "tags": []}, body)
        if rest and rest[0] == "tree" and len(rest) >= 2:
            sha = self._commit(repo, rest[1], body)
            if sha is None:
                return None
            under = "/".join(rest[2:])
            entries = [_tree_entry(p, d) for p, d in sorted(repo.commits[sha].items())
                       if not under or p.startswith(under + "/")]
            if under and not entries:
                return self._error(404, "EntryNotFound", f"{under} does not exist", body,
                                   {"X-Repo-Commit": sha})
            return self._json(entries, body)
        if not rest or (rest[0] == "revision" and len(rest) == 2):
            if rest:
                sha = self._commit(repo, rest[1], body)
            else:  # the repo's info: main's commit, or the first published one
                sha = repo.branches.get("main") or next(iter(repo.commits))
            if sha is not None:
                self._json({"id": repo_id, "modelId": repo_id, "sha": sha, "private": False,
                            "gated": repo.gated, "siblings": [{"rfilename": p} for p in
                                                              sorted(repo.commits[sha])]}, body)
            return None
        return self._error(404, "", "Not found", body)

    def _resolve(self, repo: Repo, revision: str, filename: str, body: bool, fault) -> None:
        sha = self._commit(repo, revision, body)
        if sha is None:
            return None
        data = repo.commits[sha].get(filename)
        if data is None:
            return self._error(404, "EntryNotFound", f"{filename} does not exist", body,
                               {"X-Repo-Commit": sha})
        headers = {"X-Repo-Commit": sha}
        if filename.endswith(LFS_SUFFIXES):  # LFS: a redirect to the CDN, metadata on it
            lfs = hashlib.sha256(data).hexdigest()
            headers.update({"Location": f"{self.hub.cdn}/cdn/{lfs}/{filename}", "X-Linked-Etag": f'"{lfs}"',
                            "X-Linked-Size": len(data), "ETag": f'"{git_blob_id(data)}"'})
            return self._send(302, b"", headers, body)
        headers["ETag"] = f'"{git_blob_id(data)}"'
        return self._file(data, headers, body, fault)

    def _cdn(self, sha256: str, body: bool, fault) -> None:
        data = self.hub.blob(sha256)
        if data is None:
            return self._error(404, "", "Not found", body)
        return self._file(data, {"ETag": f'"{sha256}"'}, body, fault)

    def _file(self, data: bytes, headers: dict, body: bool, fault) -> None:
        start = 0
        rng = self.headers.get("Range", "")
        if rng.startswith("bytes=") and rng[6:].split("-")[0].isdigit():
            start = min(int(rng[6:].split("-")[0]), len(data))
        part = data[start:]
        headers = {**headers, "Content-Length": len(part), "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        if fault is not None and body:
            return self._broken(headers, part, reset=fault.kind == "reset")
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            return self._send(206, part, headers, body)
        return self._send(200, part, headers, body)



def _handler(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    return type("Handler", (HubHandler,), {"hub": hub})


def _tree_entry(path: str, data: bytes) -> dict:
    entry = {"type": "file", "path": path, "size": len(data), "oid": git_blob_id(data)}
    if path.endswith(LFS_SUFFIXES):
        entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
    return entry
