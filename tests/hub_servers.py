"""Fake model registries for the tests of model downloads (pagoda/hub/fetch.py): real HTTP
servers on 127.0.0.1, each on a free port in a background thread, used as context managers
that stop themselves. Only the standard library.

- ``FakeHub``: the Hugging Face Hub as ``huggingface_hub`` (2.4) downloads from it with
  ``HF_ENDPOINT=hub.url``: ``GET /api/models/<repo>[/revision/<rev>]`` (model_info /
  repo_info), ``GET /api/models/<repo>/tree/<rev>[/<path>]`` (list_repo_tree), ``HEAD`` and
  ``GET /<repo>/resolve/<rev>/<file>``. A regular file is answered there (ETag: its git blob
  sha1); an LFS file with a 302 to a separate blob store (a second port, another origin as
  the Hub's CDN is, so the client stops its HEAD at the 302 and reads X-Linked-Etag: the
  sha256, X-Linked-Size and X-Repo-Commit from it). Errors carry ``X-Error-Code`` as the
  Hub's do: ``RepoNotFound`` (401 without a token, 404 with one), ``GatedRepo`` (401
  without the hub's token, 403 with another), ``RevisionNotFound``, ``EntryNotFound``.
- ``FakeOllamaRegistry``: Ollama's registry (Docker registry v2): ``GET
  /v2/<namespace>/<model>/manifests/<tag>`` and ``GET /v2/<namespace>/<model>/blobs/sha256:<hex>``,
  the blob answered by a 307 to a blob store on a second port (as registry.ollama.ai sends
  pulls to Cloudflare R2).

Both blob stores honour ``Range: bytes=N-`` (and ``bytes=N-M``) with 206; both log every
request in ``.requests`` (``Request(server, method, path, headers)``, header names in lower
case); both have knobs: ``fail_once`` (send N bytes of the body, then close the connection)
and ``corrupt`` (serve other bytes of the same length than the advertised digest).
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, unquote, urlsplit


@dataclass(frozen=True)
class Request:
    server: str               # which of the fake's two servers answered: "hub" / "cdn", "registry" / "store"
    method: str
    path: str                 # with the query string
    headers: dict[str, str]   # names in lower case

    @property
    def range(self) -> str | None:
        return self.headers.get("range")


@dataclass
class Response:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    fail_after: int | None = None   # send this many bytes of the body, then drop the connection


def _error(status: int, code: str | None = None, message: str = "", **headers: str) -> Response:
    if code:
        headers["X-Error-Code"] = code
    if message:
        headers["X-Error-Message"] = message
    return Response(status, json.dumps({"error": message or code or str(status)}).encode(),
                    {"Content-Type": "application/json", **headers})


def _range(request_headers: Mapping[str, str], data: bytes) -> tuple[int, bytes, dict[str, str]]:
    """(status, body, headers) of a GET of ``data``, honouring ``Range: bytes=N-`` / ``bytes=N-M``."""
    header = request_headers.get("range")
    if header is None:
        return 200, data, {"Accept-Ranges": "bytes"}
    match = re.fullmatch(r"bytes=(\d+)-(\d*)", header.strip())
    start = int(match.group(1)) if match else len(data)
    if start >= len(data):
        return 416, b"", {"Content-Range": f"bytes */{len(data)}"}
    end = min(int(match.group(2)), len(data) - 1) if match.group(2) else len(data) - 1
    return 206, data[start:end + 1], {"Accept-Ranges": "bytes", "Content-Range": f"bytes {start}-{end}/{len(data)}"}


def _spoil(data: bytes) -> bytes:
    """Other bytes of the same length (so only a digest check notices)."""
    return bytes(b ^ 0xFF for b in data) if data else data


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"   # keep-alive, as the real servers
    timeout = 30

    def setup(self) -> None:
        super().setup()
        self.server.live.add(self.connection)

    def finish(self) -> None:
        self.server.live.discard(self.connection)
        super().finish()

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - quiet
        pass

    def do_GET(self) -> None:  # noqa: N802
        self._answer()

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer()

    def _answer(self) -> None:
        headers = {k.lower(): v for k, v in self.headers.items()}
        fake, name = self.server.fake, self.server.name
        fake.requests.append(Request(name, self.command, self.path, headers))
        try:
            response = fake.route(name, self.command, self.path, headers)
        except Exception as e:  # a bug in the fake: say so instead of hanging the client
            response = Response(500, repr(e).encode(), {"Content-Type": "text/plain"})
        self.send_response(response.status)
        for key, value in response.headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(response.body)))
        self.end_headers()
        if self.command == "HEAD":
            return
        if response.fail_after is None:
            self.wfile.write(response.body)
            return
        self.wfile.write(response.body[:response.fail_after])
        self.wfile.flush()
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, fake: _Fake, name: str) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.fake, self.name = fake, name
        self.live: set[socket.socket] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request, client_address) -> None:
        pass   # a client that hung up (a test cutting a download short does)


class _Fake:
    """Two HTTP servers (the front and its blob store) sharing one request log."""

    front_name = "front"
    store_name = "store"

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._servers = {name: _HTTPServer(self, name) for name in (self.front_name, self.store_name)}
        self._threads: list[threading.Thread] = []
        self._fail_once: dict[str, int] = {}   # store key -> bytes to send before dropping the connection
        self._corrupt: set[str] = set()
        self._serving = False

    @property
    def url(self) -> str:
        return self._servers[self.front_name].url

    @property
    def store_url(self) -> str:
        return self._servers[self.store_name].url

    @property
    def host(self) -> str:
        """``127.0.0.1:PORT`` of the front server."""
        return self.url.removeprefix("http://")

    def start(self):
        self._serving = True
        for server in self._servers.values():
            thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        """Stop serving, and drop the connections clients keep alive (no answer after this)."""
        serving, self._serving = self._serving, False
        for server in self._servers.values():
            if serving:
                server.shutdown()
            for conn in list(server.live):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            server.server_close()
        for thread in self._threads:
            thread.join(timeout=5)
        self._threads.clear()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def route(self, server: str, method: str, path: str, headers: Mapping[str, str]) -> Response:
        raise NotImplementedError

    def _serve_blob(self, method: str, key: str, data: bytes, headers: Mapping[str, str], extra: Mapping[str, str]
                    ) -> Response:  # fmt: skip
        """A blob store's answer: ``data`` (or a spoilt copy), a range of it, a GET maybe cut short once."""
        if key in self._corrupt:
            data = _spoil(data)
        status, body, range_headers = _range(headers, data)
        with self._lock:
            fail_after = self._fail_once.pop(key, None) if method == "GET" else None
        return Response(status, body, {"Content-Type": "application/octet-stream", **range_headers, **extra},
                        fail_after=fail_after)


# ============================================================================ Hugging Face Hub
AGENT_HARNESSES = "/api/agent-harnesses"
LFS_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".onnx", ".msgpack", ".model")


def git_blob_sha1(data: bytes) -> str:
    """A regular file's ETag on the Hub: its git blob id."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class HubFile:
    path: str
    data: bytes
    lfs: bool

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def etag(self) -> str:
        """What the Hub advertises: the sha256 of an LFS file, else the git blob sha1."""
        return self.sha256 if self.lfs else git_blob_sha1(self.data)

    def pointer(self) -> bytes:
        return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\n"
                f"size {len(self.data)}\n").encode()  # fmt: skip


@dataclass
class HubRepo:
    repo_id: str
    files: dict[str, HubFile]
    sha: str
    gated: bool
    branches: dict[str, str]   # branch or tag -> commit


class FakeHub(_Fake):
    """The Hugging Face Hub: ``with FakeHub() as hub: hub.add_repo("org/name", {...})``, then
    ``HF_ENDPOINT=hub.url``. ``hub.token``: the token a gated repo wants (``Authorization:
    Bearer <token>``)."""

    front_name = "hub"
    store_name = "cdn"

    def __init__(self, token: str = "hf_fake_token") -> None:
        super().__init__()
        self.token = token
        self.repos: dict[str, HubRepo] = {}

    def add_repo(self, repo_id: str, files: Mapping[str, bytes | str], *, gated: bool = False,
                 lfs: Iterable[str] | None = None, branch: str = "main") -> str:  # fmt: skip
        """A model repository (one commit): file path -> content. ``lfs``: the files stored
        in LFS (default: weights by suffix, as .gitattributes does). Returns the commit sha."""
        lfs = set(lfs) if lfs is not None else {p for p in files if p.endswith(LFS_SUFFIXES)}
        entries = {path: HubFile(path, data.encode() if isinstance(data, str) else bytes(data), path in lfs)
                   for path, data in files.items()}  # fmt: skip
        digest = hashlib.sha1(repo_id.encode())
        for path in sorted(entries):
            digest.update(f"{path}\0{entries[path].etag}\0".encode())
        sha = digest.hexdigest()
        self.repos[repo_id] = HubRepo(repo_id, entries, sha, gated, {branch: sha})
        return sha

    def commit(self, repo_id: str) -> str:
        return self.repos[repo_id].sha

    def fail_once(self, repo_id: str, path: str, after_bytes: int) -> None:
        """The next download of the file's content sends ``after_bytes`` bytes, then closes the connection."""
        self._fail_once[self._key(repo_id, path)] = after_bytes

    def corrupt(self, repo_id: str, path: str, on: bool = True) -> None:
        """Serve other bytes (same length) than the sha256 / ETag the Hub advertises for the
        file (``on=False``: the right bytes again)."""
        (self._corrupt.add if on else self._corrupt.discard)(self._key(repo_id, path))

    def _key(self, repo_id: str, path: str) -> str:
        file = self.repos[repo_id].files[path]
        return file.sha256 if file.lfs else f"{repo_id}/{path}"

    def model_requests(self) -> list[Request]:
        """The requests but huggingface_hub's GET /api/agent-harnesses (which it sends once a
        process, on its first request whatever it is for, to fill its User-Agent)."""
        return [r for r in self.requests if urlsplit(r.path).path != AGENT_HARNESSES]

    def downloads(self, repo_id: str | None = None) -> list[str]:
        """Paths in the repo(s) whose content was requested (a GET on /resolve/)."""
        out = []
        for r in self.requests:
            m = re.fullmatch(r"/(.+?)/resolve/[^/]+/(.+)", urlsplit(r.path).path)
            if r.server == "hub" and r.method == "GET" and m and (repo_id is None or m.group(1) == repo_id):
                out.append(unquote(m.group(2)))
        return out

    # ------------------------------------------------------------------ routing
    def route(self, server: str, method: str, path: str, headers: Mapping[str, str]) -> Response:
        url = urlsplit(path)
        if server == "cdn":
            m = re.fullmatch(r"/lfs/([0-9a-f]{64})", url.path)
            file = self._lfs_file(m.group(1)) if m else None
            if file is None:
                return Response(404, b"NoSuchKey", {"Content-Type": "text/plain"})
            name = quote(file.path.rsplit("/", 1)[-1])
            disposition = f"inline; filename*=UTF-8''{name}; filename=\"{name}\";"
            return self._serve_blob(method, file.sha256, file.data, headers,
                                    {"ETag": f'"{file.sha256}"', "Content-Disposition": disposition})
        query = parse_qs(url.query)
        if url.path == AGENT_HARNESSES:
            return Response(200, json.dumps({"standardEnvVars": [], "harnesses": {}}).encode(),
                            {"Content-Type": "application/json"})
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", url.path):
            return self._model_info(unquote(m.group(1)), unquote(m.group(2) or "main"), headers, "blobs" in query)
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?", url.path):
            recursive = query.get("recursive", ["false"])[0].lower() in ("true", "1")
            return self._tree(unquote(m.group(1)), unquote(m.group(2)), unquote(m.group(3) or ""), headers, recursive)
        if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", url.path):
            return self._resolve(method, unquote(m.group(1)), unquote(m.group(2)), unquote(m.group(3)), headers)
        return _error(404, message="Not Found")

    def _lfs_file(self, sha256: str) -> HubFile | None:
        return next((f for repo in self.repos.values() for f in repo.files.values() if f.lfs and f.sha256 == sha256),
                    None)

    def _repo(self, repo_id: str, revision: str, headers: Mapping[str, str], content: bool
              ) -> tuple[HubRepo, str] | Response:  # fmt: skip
        """The repo and commit, or the Hub's error: unknown repo, gated repo (only for
        content: the Hub shows a gated repo's metadata and file list to anyone), unknown revision."""
        auth = headers.get("authorization", "")
        repo = self.repos.get(repo_id)
        if repo is None:
            return _error(404 if auth else 401, "RepoNotFound", "Repository not found")
        if content and repo.gated and auth != f"Bearer {self.token}":
            if auth:
                return _error(403, "GatedRepo", f"Access to model {repo_id} is restricted and you are not in the "
                                                f"authorized list. Visit https://huggingface.co/{repo_id} to ask "
                                                f"for access.")
            return _error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access to it "
                                            f"and be authenticated to access it. Please log in.")
        sha = repo.branches.get(revision, revision if revision == repo.sha else None)
        if sha is None:
            return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return repo, sha

    def _model_info(self, repo_id: str, revision: str, headers: Mapping[str, str], blobs: bool) -> Response:
        found = self._repo(repo_id, revision, headers, content=False)
        if isinstance(found, Response):
            return found
        repo, sha = found
        siblings = []
        for f in repo.files.values():
            sibling: dict = {"rfilename": f.path}
            if blobs:
                sibling.update(size=len(f.data), blobId=git_blob_sha1(f.pointer() if f.lfs else f.data))
                if f.lfs:
                    sibling["lfs"] = {"sha256": f.sha256, "size": len(f.data), "pointerSize": len(f.pointer())}
            siblings.append(sibling)
        info = {"_id": sha[:24], "id": repo_id, "modelId": repo_id, "author": repo_id.split("/")[0], "sha": sha,
                "private": False, "gated": "auto" if repo.gated else False, "disabled": False,
                "lastModified": "2025-01-01T00:00:00.000Z", "tags": [], "downloads": 0, "likes": 0,
                "siblings": siblings}  # fmt: skip
        return Response(200, json.dumps(info).encode(), {"Content-Type": "application/json"})

    def _tree(self, repo_id: str, revision: str, folder: str, headers: Mapping[str, str], recursive: bool
              ) -> Response:  # fmt: skip
        found = self._repo(repo_id, revision, headers, content=False)
        if isinstance(found, Response):
            return found
        repo, _ = found
        prefix = folder.strip("/") + "/" if folder.strip("/") else ""
        entries: dict[str, dict] = {}
        for f in sorted(repo.files.values(), key=lambda f: f.path):
            if not f.path.startswith(prefix):
                continue
            parts = f.path[len(prefix):].split("/")
            for i in range(1, len(parts)):   # the folders on the way
                sub = prefix + "/".join(parts[:i])
                if recursive or i == 1:
                    entries.setdefault(sub, {"type": "directory", "oid": hashlib.sha1(sub.encode()).hexdigest(),
                                             "size": 0, "path": sub})  # fmt: skip
            if not recursive and len(parts) > 1:
                continue
            entry = {"type": "file", "oid": git_blob_sha1(f.pointer() if f.lfs else f.data), "size": len(f.data),
                     "path": f.path}  # fmt: skip
            if f.lfs:
                entry["lfs"] = {"oid": f.sha256, "size": len(f.data), "pointerSize": len(f.pointer())}
            entries[f.path] = entry
        if prefix and not entries:
            return _error(404, "EntryNotFound", f"{folder} does not exist on \"{revision}\"")
        return Response(200, json.dumps(list(entries.values())).encode(), {"Content-Type": "application/json"})

    def _resolve(self, method: str, repo_id: str, revision: str, path: str, headers: Mapping[str, str]) -> Response:
        found = self._repo(repo_id, revision, headers, content=True)
        if isinstance(found, Response):
            return found
        repo, sha = found
        file = repo.files.get(path)
        if file is None:
            return _error(404, "EntryNotFound", f"{path} does not exist on \"{revision}\"", **{"X-Repo-Commit": sha})
        common = {"X-Repo-Commit": sha, "Access-Control-Expose-Headers": "X-Repo-Commit,X-Linked-Etag,X-Linked-Size"}
        if file.lfs:
            location = f"{self.store_url}/lfs/{file.sha256}?X-Amz-Signature=fake&repo={quote(repo_id, safe='')}"
            return Response(302, b"", {**common, "Location": location, "ETag": f'"{file.sha256}"',
                                       "X-Linked-Etag": f'"{file.sha256}"', "X-Linked-Size": str(len(file.data))})
        return self._serve_blob(method, f"{repo_id}/{path}", file.data, headers,
                                {**common, "ETag": f'"{file.etag}"'})  # fmt: skip


# ============================================================================ Ollama's registry
MANIFEST_V2 = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_V1 = "application/vnd.docker.container.image.v1+json"
OLLAMA_LAYER = "application/vnd.ollama.image."


class FakeOllamaRegistry(_Fake):
    """Ollama's registry: ``with FakeOllamaRegistry() as registry: registry.add_model("library/tiny",
    "latest", layers={"model": gguf, "params": b'{...}'})``, then pull
    ``f"{registry.host}/library/tiny:latest"`` over http. ``redirect=False``: blobs served by
    the registry itself instead of a 307 to the blob store."""

    front_name = "registry"
    store_name = "store"

    def __init__(self, redirect: bool = True) -> None:
        super().__init__()
        self.redirect = redirect
        self.blobs: dict[str, bytes] = {}       # "sha256:<hex>" -> content
        self.manifests: dict[tuple[str, str], bytes] = {}   # ("namespace/model", tag) -> manifest JSON

    def add_model(self, name: str, tag: str = "latest", layers: Mapping[str, bytes | str] | None = None,
                  config: bytes | None = None) -> dict:  # fmt: skip
        """A model ``namespace/model:tag`` whose layers are media type (or its last part:
        ``"model"``, ``"params"``, ``"template"``, ``"system"``, ``"license"``) -> content, in
        that order. Returns the manifest."""
        if name.count("/") != 1:
            raise ValueError(f"name is namespace/model, got {name!r}")
        config = config if config is not None else json.dumps(
            {"model_format": "gguf", "model_family": "llama", "file_type": "Q4_K_M"}).encode()
        manifest = {"schemaVersion": 2, "mediaType": MANIFEST_V2,
                    "config": {"mediaType": CONFIG_V1, **self._add_blob(config)},
                    "layers": [{"mediaType": media if "/" in media else OLLAMA_LAYER + media,
                                **self._add_blob(data.encode() if isinstance(data, str) else bytes(data))}
                               for media, data in (layers or {}).items()]}  # fmt: skip
        self.manifests[(name, tag)] = json.dumps(manifest, indent=None).encode()
        return manifest

    def _add_blob(self, data: bytes) -> dict:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        self.blobs[digest] = data
        return {"digest": digest, "size": len(data)}

    def manifest(self, name: str, tag: str = "latest") -> dict:
        return json.loads(self.manifests[(name, tag)])

    def layer(self, name: str, tag: str = "latest", media: str = "model") -> dict:
        """The layer descriptor (mediaType, digest, size) of a model's layer of that media type."""
        media = media if "/" in media else OLLAMA_LAYER + media
        return next(x for x in self.manifest(name, tag)["layers"] if x["mediaType"] == media)

    def fail_once(self, digest: str, after_bytes: int) -> None:
        """The next download of blob ``digest`` (``sha256:<hex>``) sends ``after_bytes`` bytes, then closes."""
        self._fail_once[digest] = after_bytes

    def corrupt(self, digest: str, on: bool = True) -> None:
        """Serve blob ``digest`` as other bytes of the same length (``on=False``: the right bytes again)."""
        (self._corrupt.add if on else self._corrupt.discard)(digest)

    def blob_requests(self, digest: str) -> list[Request]:
        """The requests that fetched blob ``digest``'s content (from the registry or the store)."""
        hex_digest = digest.removeprefix("sha256:")
        return [r for r in self.requests if r.method == "GET" and hex_digest in r.path
                and (r.server == "store" or not self.redirect)]  # fmt: skip

    def route(self, server: str, method: str, path: str, headers: Mapping[str, str]) -> Response:
        url = urlsplit(path)
        if server == "store":
            m = re.fullmatch(r"/ollama/docker/registry/v2/blobs/sha256/[0-9a-f]{2}/([0-9a-f]{64})/data", url.path)
            digest = f"sha256:{m.group(1)}" if m else None
            if digest not in self.blobs:
                return Response(404, b"<Error><Code>NoSuchKey</Code></Error>", {"Content-Type": "application/xml"})
            return self._serve_blob(method, digest, self.blobs[digest], headers, {"ETag": f'"{digest[7:]}"'})
        if m := re.fullmatch(r"/v2/([^/]+/[^/]+)/manifests/([^/]+)", url.path):
            manifest = self.manifests.get((m.group(1), m.group(2)))
            if manifest is None:
                return self._registry_error(404, "MANIFEST_UNKNOWN", "manifest unknown")
            return Response(200, manifest, {"Content-Type": MANIFEST_V2,
                                            "Docker-Content-Digest": "sha256:" + hashlib.sha256(manifest).hexdigest()})
        if m := re.fullmatch(r"/v2/([^/]+/[^/]+)/blobs/(sha256:[0-9a-f]{64})", url.path):
            digest = m.group(2)
            if digest not in self.blobs:
                return self._registry_error(404, "BLOB_UNKNOWN", "blob unknown to registry")
            if not self.redirect:
                return self._serve_blob(method, digest, self.blobs[digest], headers, {"Docker-Content-Digest": digest})
            hex_digest = digest[7:]
            location = (f"{self.store_url}/ollama/docker/registry/v2/blobs/sha256/{hex_digest[:2]}/{hex_digest}/data"
                        f"?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Signature=fake")  # fmt: skip
            return Response(307, b"", {"Location": location, "Docker-Content-Digest": digest})
        return self._registry_error(404, "NAME_UNKNOWN", "repository name not known to registry")

    @staticmethod
    def _registry_error(status: int, code: str, message: str) -> Response:
        body = json.dumps({"errors": [{"code": code, "message": message, "detail": None}]}).encode()
        return Response(status, body, {"Content-Type": "application/json"})
