"""A Hub-compatible HTTP server on 127.0.0.1 for tests: create repos, commit files, download them.

It speaks the subset of the Hub API that `huggingface_hub` (1.x and 2.x) really sends for
`create_repo` / `upload_folder` / `push_to_hub` and `hf_hub_download` / `snapshot_download` / `from_pretrained`:

- `POST /api/repos/create` (409 when the repo exists)
- `POST /api/validate-yaml`
- `POST /api/{type}s/{ns}/{name}/preupload/{rev}`: every file is uploaded "regular" (base64 in the commit)
- `POST /api/{type}s/{ns}/{name}/commit/{rev}`: ndjson lines header / file / deletedFile / deletedFolder
  (`lfsFile` is refused: this server never asks for LFS)
- `HEAD|GET /[{type}s/]{ns}/{name}/resolve/{rev}/{path}` with `X-Repo-Commit`, `ETag` and `Content-Length`;
  404 with `X-Error-Code: RepoNotFound` / `RevisionNotFound` / `EntryNotFound`
- `GET /api/{type}s/{ns}/{name}[/revision/{rev}]` (repo info with `sha` and `siblings`)
- `GET /api/whoami-v2`

Clients must run with `HF_HUB_DISABLE_XET=1` (no Xet storage here). Files live in memory; each commit is a new
snapshot with a sha1 id. Requests the server does not know get a 404 and are recorded in `server.unknown`.

Run standalone: `python tests/hub_server.py` prints the endpoint and serves until interrupted.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

REPO_TYPES = ("model", "dataset", "space")


class Repo:
    def __init__(self, repo_id: str, repo_type: str):
        self.repo_id, self.repo_type = repo_id, repo_type
        self.commits: list[tuple[str, dict[str, bytes]]] = []  # (sha, files) oldest first
        self.headers: list[dict] = []  # the header of every commit received (summary, description), oldest first
        self._commit({}, "initial commit")

    def _commit(self, files: dict[str, bytes], message: str) -> str:
        parent = self.commits[-1][0] if self.commits else ""
        digest = hashlib.sha1(f"{self.repo_id}\n{parent}\n{message}\n{time.time_ns()}".encode())
        for path in sorted(files):
            digest.update(path.encode() + b"\0" + hashlib.sha256(files[path]).digest())
        sha = digest.hexdigest()
        self.commits.append((sha, files))
        return sha

    def snapshot(self, revision: str) -> tuple[str, dict[str, bytes]] | None:
        if revision == "main":
            return self.commits[-1]
        return next((c for c in self.commits if c[0] == revision), None)


class HubState:
    def __init__(self):
        self.lock = threading.Lock()
        self.repos: dict[tuple[str, str], Repo] = {}
        self.unknown: list[str] = []
        self.requests: list[str] = []


class HubHandler(BaseHTTPRequestHandler):
    server_version = "QuantMLATestHub/1.0"
    protocol_version = "HTTP/1.1"

    @property
    def state(self) -> HubState:
        return self.server.state

    def log_message(self, fmt, *args):  # keep test output clean
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head and body:
            self.wfile.write(body)

    def _json(self, status: int, obj, headers: dict | None = None, head: bool = False):
        self._send(status, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})}, head)

    def _error(self, status: int, code: str | None, message: str, head: bool = False):
        headers = {"X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        self._json(status, {"error": message}, headers, head)

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _endpoint(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def _route(self, method: str):
        path = unquote(urlsplit(self.path).path)
        self.state.requests.append(f"{method} {path}")
        head = method == "HEAD"
        if method == "GET" and path == "/api/whoami-v2":
            return self._json(200, {"type": "user", "name": "tester", "fullname": "Test User", "orgs": [],
                                    "auth": {"type": "access_token", "accessToken": {"role": "write"}}})
        if method == "POST" and path == "/api/repos/create":
            return self._create_repo(json.loads(self._body() or b"{}"))
        if method == "POST" and path == "/api/validate-yaml":
            self._body()
            return self._json(200, {"errors": [], "warnings": []})
        m = re.fullmatch(r"/api/(model|dataset|space)s/([^/]+/[^/]+)/(preupload|commit)/(.+)", path)
        if m and method == "POST":
            repo = self._repo(m.group(1), m.group(2))
            if repo is None:
                return self._error(404, "RepoNotFound", f"Repository {m.group(2)} not found")
            body = self._body()
            return self._preupload(repo, body) if m.group(3) == "preupload" else self._commit(repo, body)
        m = re.fullmatch(r"/api/(model|dataset|space)s/([^/]+/[^/]+?)(?:/revision/(.+))?", path)
        if m and method == "GET":
            return self._info(m.group(1), m.group(2), m.group(3) or "main")
        m = re.fullmatch(r"/(?:(dataset|space)s/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m and method in ("GET", "HEAD"):
            return self._resolve(m.group(1) or "model", m.group(2), m.group(3), m.group(4), head)
        self.state.unknown.append(f"{method} {self.path}")
        return self._error(404, None, f"unknown endpoint {method} {path}", head)

    def do_GET(self):
        self._route("GET")

    def do_HEAD(self):
        self._route("HEAD")

    def do_POST(self):
        self._route("POST")

    def do_PUT(self):
        self._route("PUT")

    def _repo(self, repo_type: str, repo_id: str) -> Repo | None:
        return self.state.repos.get((repo_type, repo_id))

    def _create_repo(self, payload: dict):
        name, org = payload.get("name"), payload.get("organization") or "tester"
        repo_type = payload.get("type") or "model"
        if not name or repo_type not in REPO_TYPES:
            return self._error(400, None, f"bad create payload {payload!r}")
        repo_id = f"{org}/{name}"
        url = f"{self._endpoint()}/{'' if repo_type == 'model' else repo_type + 's/'}{repo_id}"
        with self.state.lock:
            if (repo_type, repo_id) in self.state.repos:
                return self._json(409, {"error": "You already created this model repo", "url": url})
            self.state.repos[(repo_type, repo_id)] = Repo(repo_id, repo_type)
        return self._json(200, {"url": url, "name": repo_id, "id": repo_id})

    def _preupload(self, repo: Repo, body: bytes):
        files = json.loads(body or b"{}").get("files", [])
        return self._json(200, {"files": [
            {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None} for f in files
        ]})

    def _commit(self, repo: Repo, body: bytes):
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            return self._error(400, None, "a commit starts with a header line")
        with self.state.lock:
            files = dict(repo.commits[-1][1])
            for line in lines[1:]:
                key, value = line.get("key"), line.get("value", {})
                if key == "file":
                    if value.get("encoding") != "base64":
                        return self._error(400, None, f"unsupported encoding {value.get('encoding')!r}")
                    files[value["path"]] = base64.b64decode(value["content"])
                elif key == "deletedFile":
                    if files.pop(value["path"], None) is None:
                        return self._error(404, "EntryNotFound", "A file with this name doesn't exist")
                elif key == "deletedFolder":
                    prefix = value["path"].rstrip("/") + "/"
                    files = {p: b for p, b in files.items() if not p.startswith(prefix)}
                else:  # lfsFile, copies: this server never asks for them
                    return self._error(400, None, f"unsupported commit operation {key!r}")
            repo.headers.append(dict(lines[0]["value"]))
            sha = repo._commit(files, lines[0]["value"].get("summary", ""))
        return self._json(200, {"commitUrl": f"{self._endpoint()}/{repo.repo_id}/commit/{sha}",
                                "commitOid": sha, "pullRequestUrl": None, "success": True})

    def _info(self, repo_type: str, repo_id: str, revision: str):
        repo = self._repo(repo_type, repo_id)
        if repo is None:
            return self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
        snap = repo.snapshot(revision)
        if snap is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        sha, files = snap
        return self._json(200, {
            "_id": sha[:24], "id": repo_id, "modelId": repo_id, "sha": sha, "private": False, "disabled": False,
            "gated": False, "downloads": 0, "likes": 0, "tags": [], "library_name": "transformers",
            "lastModified": "2025-01-01T00:00:00.000Z", "createdAt": "2025-01-01T00:00:00.000Z",
            "siblings": [{"rfilename": p, "size": len(b)} for p, b in sorted(files.items())],
        })

    def _resolve(self, repo_type: str, repo_id: str, revision: str, path: str, head: bool):
        repo = self._repo(repo_type, repo_id)
        if repo is None:
            return self._error(401, "RepoNotFound", f"Repository {repo_id} not found", head)
        snap = repo.snapshot(revision)
        if snap is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", head)
        sha, files = snap
        if path not in files:
            return self._error(404, "EntryNotFound", f"Entry not found: {path}", head)
        data = files[path]
        etag = '"' + hashlib.sha256(data).hexdigest() + '"'
        return self._send(200, data, {"X-Repo-Commit": sha, "ETag": etag,
                                      "Content-Type": "application/octet-stream"}, head)


class HubServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int = 0):
        super().__init__(("127.0.0.1", port), HubHandler)
        self.state = HubState()

    @property
    def endpoint(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "HubServer":
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class SilentServer:
    """Accepts TCP connections on 127.0.0.1 and never answers: a Hub that hangs (for timeout tests)."""

    def __init__(self):
        import socket

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)  # the kernel completes the handshakes; nothing is ever read or written

    @property
    def endpoint(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"http://{host}:{port}"

    def close(self) -> None:
        self.sock.close()


if __name__ == "__main__":
    server = HubServer()
    print(server.endpoint, flush=True)
    server.serve_forever()
