"""A small Hugging Face Hub-compatible HTTP server for tests (loopback only, in-memory storage).

It speaks the subset of the Hub protocol that ``huggingface_hub`` 2.4 uses to create a repo,
upload files (preupload, git-LFS batch + PUT, NDJSON commit), read repo info and file trees, and
download files (HEAD/GET on ``/{repo}/resolve/{revision}/{path}``, with ``Range`` support), see
``shared/docs/HUB.md``. Repositories have a real commit graph: every commit has an oid and a
parent, branches and ``refs/pr/N`` point at commits, and any of them resolves a revision.

Knobs for tests:

- ``tokens``: ``{token: user}``; when given, a wrong token is answered 401 ("Invalid
  credentials"), a private repo is invisible to others, writes need a token and the namespace.
- ``corrupt(repo_id, path)``: flip bytes of a stored blob without changing its recorded hashes.
- ``corrupt_once(path, offset)``: the next GET of ``path`` that sends byte ``offset`` carries it
  flipped.
- ``fail_once(path, status)``: the next GET of ``path`` is answered with that status.
- ``drop_once(path, after)``: the next GET of ``path`` that would send more than ``after`` bytes
  sends ``after`` and closes the connection (an interrupted download).
- ``pending_faults()``: the one-off faults above that no request has met yet.
- ``trickle(path, rate)``: every GET of ``path`` sends its body at ``rate`` bytes a second.
- ``drop_always(path, after)``: every GET of ``path`` sends ``after`` bytes and hangs up.
- ``truncate_lfs_uploads``: keep only the first half of every LFS upload, without complaint,
  and commit what was kept (a storage fault the uploader is not told of).
- ``hide_hashes``: repo listings with file metadata give sizes but no LFS sha256 or git blob
  id (a Hub that cannot show what it holds).
- ``wrong_commit``: file answers name another commit in ``X-Repo-Commit`` (a confused proxy).
- ``stall_api``: seconds every ``/api/...`` call waits before it is answered (a stalled Hub).
- ``ignore_ranges``: answer ``Range`` requests with the whole file, like a server without
  range support.
- ``log``: every request as ``{"method", "path", "file", "range", "status", "sent", "auth"}``.

Use as a context manager (``with HubServer() as hub: ... hub.url``); it listens on 127.0.0.1 on
a free port and stops (closing every connection) on exit.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, unquote, urlsplit

_LFS_SUFFIXES = (".lct", ".safetensors", ".bin", ".npy", ".pt")
_REGULAR_MAX = 10 * 1024 * 1024
_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")


def git_blob_oid(data: bytes) -> str:
    """The git blob sha1 of ``data`` (what the Hub reports as a regular file's oid)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\n"
            f"size {size}\n").encode()


@dataclass
class FileEntry:
    path: str
    size: int
    blob_oid: str                 # git oid: sha1 of the content, or of the LFS pointer
    lfs_sha256: str | None = None
    pointer_size: int = 0

    @property
    def etag(self) -> str:
        return self.lfs_sha256 or self.blob_oid


@dataclass
class Commit:
    oid: str
    parent: str | None
    tree: dict                    # path -> FileEntry
    title: str
    description: str
    date: str


@dataclass
class Repo:
    repo_id: str
    owner: str
    private: bool
    branches: dict = field(default_factory=dict)   # name -> commit oid
    commits: dict = field(default_factory=dict)    # oid -> Commit
    prs: list = field(default_factory=list)        # commit oids of refs/pr/1, 2, ...


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, headers=None,
                 body: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.headers = headers or {}
        self.body = body or {}


class HubServer:
    """A Hub-compatible server on 127.0.0.1 (see the module docstring)."""

    def __init__(self, tokens: dict | None = None, redirect_lfs: bool = True):
        self.tokens = tokens
        self.redirect_lfs = redirect_lfs
        self.ignore_ranges = False       # answer Range requests with the whole file (200)
        self.truncate_lfs_uploads = False
        self.hide_hashes = False
        self.stall_api = 0.0
        self.wrong_commit = False
        self.repos: dict = {}
        self.lfs: dict = {}              # sha256 -> bytearray
        self.regular: dict = {}          # git oid -> bytes
        self.log: list = []
        self._drops: dict = {}           # path -> bytes to send before dropping
        self._flips: dict = {}           # path -> file offset flipped in the next body sent
        self._fails: dict = {}           # path -> HTTP status answered to its next GET
        self._trickles: dict = {}        # path -> bytes a second for every GET
        self._always_drop: dict = {}     # path -> bytes every GET sends before hanging up
        self._lock = threading.RLock()
        self._conns: set = set()
        self._httpd = None
        self._thread = None
        self.url = None

    # Lifecycle -----------------------------------------------------------------------------
    def start(self) -> "HubServer":
        server = self

        class Handler(_Handler):
            hub = server

        class Httpd(ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True

            def handle_error(self, request, client_address):
                pass  # a client that hangs up (or a dropped test connection) is not news

        self._httpd = Httpd(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        kwargs={"poll_interval": 0.05},
                                        name="hub-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is None:
            return
        self._httpd.shutdown()
        with self._lock:
            for conn in list(self._conns):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._httpd.server_close()
        self._thread.join(5)
        self._httpd = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False

    # Knobs ---------------------------------------------------------------------------------
    def corrupt(self, repo_id: str, path: str, revision: str = "main", offset: int | None = None,
                nbytes: int = 16) -> None:
        """Flip ``nbytes`` bytes of the stored content of ``path`` (default: its middle)."""
        with self._lock:
            entry = self._commit(self.repos[repo_id], revision).tree[path]
            if entry.lfs_sha256:
                blob = self.lfs[entry.lfs_sha256]
            else:
                blob = bytearray(self.regular[entry.blob_oid])
                self.regular[entry.blob_oid] = blob
            start = len(blob) // 2 if offset is None else offset
            for i in range(start, min(start + nbytes, len(blob))):
                blob[i] ^= 0xFF

    def drop_once(self, path: str, after: int) -> None:
        """The next GET of file ``path`` that would send more than ``after`` bytes stops after
        ``after`` and drops the connection."""
        with self._lock:
            self._drops[path] = after

    def trickle(self, path: str, rate: int) -> None:
        """Every GET of file ``path`` sends its body at ``rate`` bytes a second (0: normal)."""
        with self._lock:
            self._trickles[path] = rate

    def drop_always(self, path: str, after: int) -> None:
        """Every GET of file ``path`` sends ``after`` bytes and drops the connection."""
        with self._lock:
            self._always_drop[path] = after

    def fail_once(self, path: str, status: int = 500) -> None:
        """The next GET of file ``path`` is answered with ``status`` (a transient server fault)."""
        with self._lock:
            self._fails[path] = status

    def corrupt_once(self, path: str, offset: int) -> None:
        """The next GET of file ``path`` that sends byte ``offset`` carries it flipped (a
        transient fault: the stored content stays intact)."""
        with self._lock:
            self._flips[path] = offset

    def pending_faults(self) -> dict:
        """The one-off faults not yet met: ``{"fail"|"flip"|"drop": {path: value}}``, empty
        parts left out (a test shows that its fault was met by asserting this is empty)."""
        with self._lock:
            return {k: dict(v) for k, v in (("fail", self._fails), ("flip", self._flips),
                                            ("drop", self._drops)) if v}

    def requests_for(self, path: str, method: str | None = None) -> list:
        """Logged requests whose file is ``path`` (resolve and LFS download URLs)."""
        return [r for r in self.log
                if r["file"] == path and (method is None or r["method"] == method)]

    def clear_log(self) -> None:
        with self._lock:
            self.log.clear()

    def head(self, repo_id: str, revision: str = "main") -> Commit:
        """The commit ``revision`` of ``repo_id`` resolves to."""
        return self._commit(self.repos[repo_id], revision)

    def blob(self, repo_id: str, path: str, revision: str = "main") -> bytes:
        """The stored content of ``path``."""
        entry = self._commit(self.repos[repo_id], revision).tree[path]
        store = self.lfs if entry.lfs_sha256 else self.regular
        return bytes(store[entry.etag])

    # Model ---------------------------------------------------------------------------------
    def _commit(self, repo: Repo, revision: str) -> Commit:
        rev = unquote(revision)
        if rev in repo.branches:
            return repo.commits[repo.branches[rev]]
        m = re.fullmatch(r"refs/pr/(\d+)", rev)
        if m and 1 <= int(m.group(1)) <= len(repo.prs):
            return repo.commits[repo.prs[int(m.group(1)) - 1]]
        if rev in repo.commits:
            return repo.commits[rev]
        raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")

    def _user(self, auth: str | None) -> str | None:
        if self.tokens is None:
            return "anonymous"
        if not auth:
            return None
        token = auth.split(" ", 1)[1] if auth.lower().startswith("bearer ") else auth
        user = self.tokens.get(token)
        if user is None:
            raise HubError(401, "Invalid credentials in Authorization header")
        return user

    def _repo(self, repo_id: str, user: str | None, write: bool = False) -> Repo:
        repo = self.repos.get(repo_id)
        visible = repo is not None and (not repo.private or self.tokens is None
                                        or user == repo.owner)
        if not visible:
            # The Hub answers 401 to anonymous callers and 404 to others, for missing and private
            # repos alike.
            raise HubError(401 if user is None else 404, "Repository not found", "RepoNotFound")
        if write:
            if user is None:
                raise HubError(401, "You must be authenticated to write")
            if self.tokens is not None and user != repo.owner:
                raise HubError(403, f"You don't have the rights to write to {repo_id}")
        return repo

    def _new_commit(self, repo: Repo, parent: str | None, tree: dict, title: str,
                    description: str) -> Commit:
        h = hashlib.sha1()
        h.update(json.dumps([parent, title, description, time.time_ns(),
                             sorted((p, e.blob_oid) for p, e in tree.items())]).encode())
        c = Commit(h.hexdigest(), parent, tree, title, description,
                   time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime()))
        repo.commits[c.oid] = c
        return c


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: HubServer = None
    timeout = 30                      # an idle keep-alive connection is closed after this

    def setup(self):
        super().setup()
        with self.hub._lock:
            self.hub._conns.add(self.connection)

    def finish(self):
        try:
            super().finish()
        finally:
            with self.hub._lock:
                self.hub._conns.discard(self.connection)

    def log_message(self, fmt, *args):  # keep test output quiet
        pass

    # Plumbing ------------------------------------------------------------------------------
    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                line = self.rfile.readline().strip()
                n = int(line.split(b";")[0], 16)
                if n == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(n)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _record(self, status: int, sent: int, file: str | None) -> None:
        with self.hub._lock:
            self.hub.log.append({"method": self.command, "path": self.path, "file": file,
                                 "range": self.headers.get("Range"), "status": status,
                                 "sent": sent,
                                 "auth": self.headers.get("Authorization") is not None})

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None,
              file: str | None = None, content_type: str = "application/json") -> None:
        self.send_response(status)
        hdrs = {"Content-Type": content_type, "Content-Length": str(len(body))}
        hdrs.update(headers or {})
        for k, v in hdrs.items():
            self.send_header(k, v)
        self.end_headers()
        sent = 0
        if self.command != "HEAD" and body:
            self.wfile.write(body)
            sent = len(body)
        self._record(status, sent, file)

    def _json(self, obj, status: int = 200, headers=None) -> None:
        self._send(status, json.dumps(obj).encode(), headers)

    def _error(self, e: HubError, file: str | None = None) -> None:
        headers = dict(e.headers)
        headers["X-Error-Message"] = e.message
        if e.code:
            headers["X-Error-Code"] = e.code
        self._send(e.status, json.dumps({"error": e.message, **e.body}).encode(), headers,
                   file=file)

    def _dispatch(self) -> None:
        parts = urlsplit(self.path)
        self.query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        segs = parts.path.split("/")[1:]
        file = None
        try:
            self._body_bytes = self._body() if self.command in ("POST", "PUT") else b""
            if segs[:2] == ["__lfs", "upload"]:
                return self._lfs_put(segs[2])
            if segs[:2] == ["__lfs", "download"]:
                file = unquote("/".join(segs[4:]))
                return self._lfs_get(segs[2], unquote(segs[3]), file)
            user = self.hub._user(self.headers.get("Authorization"))
            if segs[:1] == ["api"]:
                if self.hub.stall_api:
                    time.sleep(self.hub.stall_api)
                return self._api(segs[1:], user)
            if len(segs) >= 5 and segs[-4:] == ["info", "lfs", "objects", "batch"]:
                repo_id = unquote("/".join(segs[:-4]))
                repo_id = repo_id[:-4] if repo_id.endswith(".git") else repo_id
                return self._lfs_batch(repo_id, user)
            for i in (1, 2):
                if len(segs) > i + 2 and segs[i] == "resolve":
                    repo_id = "/".join(unquote(s) for s in segs[:i])
                    file = unquote("/".join(segs[i + 2:]))
                    return self._resolve(repo_id, unquote(segs[i + 1]), file, user)
            raise HubError(404, f"no route for {parts.path}")
        except HubError as e:
            self._error(e, file)
        except (ConnectionError, BrokenPipeError):
            self.close_connection = True

    do_GET = do_HEAD = do_POST = do_PUT = _dispatch

    # API -----------------------------------------------------------------------------------
    def _api(self, segs: list, user: str | None) -> None:
        hub = self.hub
        method = self.command
        if segs == ["repos", "create"] and method == "POST":
            return self._create(json.loads(self._body_bytes or b"{}"), user)
        if segs == ["validate-yaml"] and method == "POST":
            return self._json({"errors": [], "warnings": []})
        if segs == ["whoami-v2"] and method == "GET":
            if user is None:
                raise HubError(401, "Invalid username or password.")
            return self._json({"type": "user", "name": user, "auth": {}})
        if len(segs) < 3 or segs[0] != "models":
            raise HubError(404, f"no route for /api/{'/'.join(segs)}")
        # /api/models/{ns}/{name}[/{action}/{rev}...]
        repo_id = "/".join(unquote(s) for s in segs[1:3])
        rest = segs[3:]
        with hub._lock:
            if not rest and method == "GET":
                return self._info(repo_id, "main", user)
            if rest[:1] == ["revision"] and len(rest) == 2 and method == "GET":
                return self._info(repo_id, rest[1], user)
            if rest[:1] == ["tree"] and len(rest) >= 2 and method == "GET":
                return self._tree(repo_id, rest[1], unquote("/".join(rest[2:])), user)
            if rest[:1] == ["preupload"] and len(rest) == 2 and method == "POST":
                return self._preupload(repo_id, rest[1], user)
            if rest[:1] == ["commit"] and len(rest) == 2 and method == "POST":
                return self._api_commit(repo_id, rest[1], user)
            if rest[:1] == ["branch"] and len(rest) == 2 and method == "POST":
                return self._branch(repo_id, unquote(rest[1]), user)
        raise HubError(404, f"no route for /api/{'/'.join(segs)}")

    def _create(self, payload: dict, user: str | None) -> None:
        hub = self.hub
        if user is None:
            raise HubError(401, "You must be authenticated to create a repo")
        ns = payload.get("organization") or user
        name = payload.get("name")
        if not name:
            raise HubError(400, "missing name")
        if hub.tokens is not None and ns != user:
            raise HubError(403, f"You don't have the rights to create a repo under {ns}")
        repo_id = f"{ns}/{name}"
        private = bool(payload.get("private")) or payload.get("visibility") == "private"
        with hub._lock:
            if repo_id in hub.repos:
                raise HubError(409, "You already created this model repo",
                               body={"url": f"{hub.url}/{repo_id}"})
            repo = Repo(repo_id, ns if hub.tokens is not None else user, private)
            hub.repos[repo_id] = repo
            first = hub._new_commit(repo, None, {".gitattributes": self._gitattributes()},
                                    "initial commit", "")
            repo.branches["main"] = first.oid
        self._json({"url": f"{hub.url}/{repo_id}", "name": repo_id, "id": repo_id})

    def _gitattributes(self) -> FileEntry:
        data = "".join(f"*{s} filter=lfs diff=lfs merge=lfs -text\n"
                       for s in _LFS_SUFFIXES).encode()
        oid = git_blob_oid(data)
        self.hub.regular[oid] = data
        return FileEntry(".gitattributes", len(data), oid)

    def _info(self, repo_id: str, revision: str, user: str | None) -> None:
        repo = self.hub._repo(repo_id, user)
        c = self.hub._commit(repo, revision)
        blobs = self.query.get("blobs") in ("True", "true", "1")
        siblings = []
        for p, e in sorted(c.tree.items()):
            s = {"rfilename": p}
            if blobs and self.hub.hide_hashes:
                s.update(size=e.size)
            elif blobs:
                s.update(size=e.size, blobId=e.blob_oid)
                if e.lfs_sha256:
                    s["lfs"] = {"sha256": e.lfs_sha256, "size": e.size,
                                "pointerSize": e.pointer_size}
            siblings.append(s)
        info = {"_id": repo_id, "id": repo_id, "modelId": repo_id, "author": repo.owner,
                "sha": c.oid, "lastModified": c.date, "private": repo.private,
                "disabled": False, "gated": False, "tags": [], "siblings": siblings,
                "downloads": 0, "likes": 0}
        card = self._card_data(c)
        if card is not None:
            info["cardData"] = card
        self._json(info)

    def _card_data(self, c: Commit) -> dict | None:
        """The front matter of the commit's README.md, as the Hub's ``cardData``."""
        import yaml
        entry = c.tree.get("README.md")
        if entry is None or entry.lfs_sha256:
            return None
        text = bytes(self.hub.regular[entry.blob_oid]).decode("utf-8", "replace")
        m = re.match(r"^---\n(.*?)\n---", text, re.S)
        try:
            data = yaml.safe_load(m.group(1)) if m else None
        except yaml.YAMLError:
            return None
        return data if isinstance(data, dict) else None

    def _tree(self, repo_id: str, revision: str, sub: str, user: str | None) -> None:
        repo = self.hub._repo(repo_id, user)
        c = self.hub._commit(repo, revision)
        recursive = self.query.get("recursive") in ("True", "true", "1")
        prefix = sub.strip("/") + "/" if sub.strip("/") else ""
        out, folders = [], set()
        for p, e in sorted(c.tree.items()):
            if not p.startswith(prefix):
                continue
            rel = p[len(prefix):]
            if "/" in rel:
                top = prefix + rel.split("/", 1)[0]
                if top not in folders:
                    folders.add(top)
                    out.append({"type": "directory", "oid": "0" * 40, "size": 0, "path": top})
                if not recursive:
                    continue
            d = {"type": "file", "oid": e.blob_oid, "size": e.size, "path": p}
            if e.lfs_sha256:
                d["lfs"] = {"oid": e.lfs_sha256, "size": e.size, "pointerSize": e.pointer_size}
            out.append(d)
        self._json(out)

    def _preupload(self, repo_id: str, revision: str, user: str | None) -> None:
        repo = self.hub._repo(repo_id, user, write=True)
        try:
            tree = self.hub._commit(repo, revision).tree
        except HubError:
            tree = {}
        files = []
        for f in json.loads(self._body_bytes).get("files", []):
            path, size = f["path"], int(f["size"])
            sample = base64.b64decode(f.get("sample", ""))
            lfs = path.endswith(_LFS_SUFFIXES) or size > _REGULAR_MAX or b"\0" in sample
            old = tree.get(path)
            oid = None
            if old is not None and bool(old.lfs_sha256) == lfs:
                oid = old.lfs_sha256 or old.blob_oid
            files.append({"path": path, "uploadMode": "lfs" if lfs else "regular",
                          "shouldIgnore": False, "oid": oid})
        self._json({"files": files, "commitOid": None})

    def _lfs_batch(self, repo_id: str, user: str | None) -> None:
        hub = self.hub
        with hub._lock:
            hub._repo(repo_id, user, write=True)
            req = json.loads(self._body_bytes)
            if req.get("operation") != "upload":
                raise HubError(400, "only uploads are supported")
            objects = []
            for o in req.get("objects", []):
                oid, size = o["oid"], int(o["size"])
                obj = {"oid": oid, "size": size, "authenticated": True}
                if oid not in hub.lfs or len(hub.lfs[oid]) != size:
                    obj["actions"] = {"upload": {"href": f"{hub.url}/__lfs/upload/{oid}",
                                                 "header": {}, "expires_in": 3600}}
                objects.append(obj)
        self._json({"transfer": "basic", "objects": objects, "hash_algo": "sha256"},
                   headers={"Content-Type": "application/vnd.git-lfs+json"})

    def _lfs_put(self, oid: str) -> None:
        data = self._body_bytes
        if hashlib.sha256(data).hexdigest() != oid:
            raise HubError(400, "sha256 of the uploaded object does not match its oid")
        if self.hub.truncate_lfs_uploads:
            data = data[: len(data) // 2]
        with self.hub._lock:
            self.hub.lfs[oid] = bytearray(data)
        self._send(200, b"")

    def _api_commit(self, repo_id: str, revision: str, user: str | None) -> None:
        hub = self.hub
        repo = hub._repo(repo_id, user, write=True)
        create_pr = self.query.get("create_pr") == "1"
        rev = unquote(revision)
        parent = hub._commit(repo, rev)
        lines = [json.loads(x) for x in self._body_bytes.splitlines() if x.strip()]
        header = next((x["value"] for x in lines if x["key"] == "header"), {})
        if header.get("parentCommit") and header["parentCommit"] != parent.oid:
            raise HubError(412, "A commit has happened since. Please refresh and try again.")
        tree = dict(parent.tree)
        for x in lines:
            key, v = x["key"], x.get("value", {})
            if key == "file":
                data = base64.b64decode(v["content"])
                oid = git_blob_oid(data)
                hub.regular[oid] = data
                tree[v["path"]] = FileEntry(v["path"], len(data), oid)
            elif key == "lfsFile":
                sha, size = v["oid"], int(v["size"])
                if hub.truncate_lfs_uploads and sha in hub.lfs:
                    kept = bytes(hub.lfs[sha])
                    size = len(kept)
                    sha = hashlib.sha256(kept).hexdigest()
                    hub.lfs[sha] = bytearray(kept)
                if sha not in hub.lfs or len(hub.lfs[sha]) != size:
                    raise HubError(422, f"LFS object {sha} of {v['path']} was not uploaded")
                ptr = lfs_pointer(sha, size)
                tree[v["path"]] = FileEntry(v["path"], size, git_blob_oid(ptr), sha, len(ptr))
            elif key == "deletedFile":
                if tree.pop(v["path"], None) is None:
                    raise HubError(404, f"{v['path']} does not exist", "EntryNotFound")
            elif key == "deletedFolder":
                pre = v["path"].rstrip("/") + "/"
                for p in [p for p in tree if p.startswith(pre)]:
                    del tree[p]
        c = hub._new_commit(repo, parent.oid, tree, header.get("summary", ""),
                            header.get("description", ""))
        out = {"commitUrl": f"{hub.url}/{repo_id}/commit/{c.oid}", "commitOid": c.oid,
               "success": True}
        if create_pr:
            repo.prs.append(c.oid)
            out["pullRequestUrl"] = f"{hub.url}/{repo_id}/discussions/{len(repo.prs)}"
        else:
            if rev not in repo.branches and not re.fullmatch(r"refs/pr/\d+", rev):
                raise HubError(400, f"{rev} is not a branch")
            m = re.fullmatch(r"refs/pr/(\d+)", rev)
            if m:
                repo.prs[int(m.group(1)) - 1] = c.oid
            else:
                repo.branches[rev] = c.oid
            out["pullRequestUrl"] = None
        self._json(out)

    def _branch(self, repo_id: str, branch: str, user: str | None) -> None:
        hub = self.hub
        repo = hub._repo(repo_id, user, write=True)
        if branch in repo.branches:
            raise HubError(409, f"Reference refs/heads/{branch} already exists")
        start = json.loads(self._body_bytes or b"{}").get("startingPoint") or "main"
        repo.branches[branch] = hub._commit(repo, start).oid
        self._json({})

    # Downloads -----------------------------------------------------------------------------
    def _resolve(self, repo_id: str, revision: str, path: str, user: str | None) -> None:
        hub = self.hub
        with hub._lock:
            repo = hub._repo(repo_id, user)
            c = hub._commit(repo, revision)
            entry = c.tree.get(path)
            if entry is None:
                raise HubError(404, f"Entry not found: {path}", "EntryNotFound",
                               headers={"X-Repo-Commit": c.oid})
            headers = self._file_headers(entry, "f" * 40 if hub.wrong_commit else c.oid)
            if entry.lfs_sha256 and hub.redirect_lfs:
                # Like the Hub: LFS files redirect to the storage URL, which serves the bytes.
                headers["Location"] = (f"{hub.url}/__lfs/download/{entry.lfs_sha256}/{c.oid}/"
                                       f"{quote(path)}")
                headers["Content-Length"] = "0"
                self.send_response(302)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self._record(302, 0, path)
                return
            data = hub.lfs[entry.lfs_sha256] if entry.lfs_sha256 else hub.regular[entry.blob_oid]
        self._serve(data, headers, path)

    def _lfs_get(self, sha: str, commit: str, path: str) -> None:
        hub = self.hub
        with hub._lock:
            data = hub.lfs.get(sha)
            if data is None:
                raise HubError(404, "no such object")
            size = len(data)
            headers = {"X-Repo-Commit": commit, "ETag": f'"{sha}"', "X-Linked-Etag": f'"{sha}"',
                       "X-Linked-Size": str(size), "Accept-Ranges": "bytes"}
        self._serve(data, headers, path)

    @staticmethod
    def _file_headers(entry: FileEntry, commit: str) -> dict:
        h = {"X-Repo-Commit": commit, "ETag": f'"{entry.etag}"', "Accept-Ranges": "bytes"}
        if entry.lfs_sha256:
            h["X-Linked-Etag"] = f'"{entry.lfs_sha256}"'
            h["X-Linked-Size"] = str(entry.size)
        return h

    def _serve(self, data, headers: dict, path: str) -> None:
        if self.command == "GET":
            with self.hub._lock:
                fail = self.hub._fails.pop(path, None)
            if fail is not None:
                raise HubError(fail, "injected server fault")
        size = len(data)
        start, end, status = 0, size - 1, 200
        rng = None if self.hub.ignore_ranges else self.headers.get("Range")
        if rng:
            m = _RANGE.match(rng.strip())
            if not m or (not m.group(1) and not m.group(2)):
                raise HubError(416, f"bad range {rng}",
                               headers={"Content-Range": f"bytes */{size}"})
            if m.group(1):
                start = int(m.group(1))
                end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
            else:
                start, end = max(size - int(m.group(2)), 0), size - 1
            if start >= size or start > end:
                raise HubError(416, f"range {rng} not satisfiable",
                               headers={"Content-Range": f"bytes */{size}"})
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        body = bytes(data[start:end + 1])
        headers["Content-Length"] = str(len(body))
        self.send_response(status)
        headers.setdefault("Content-Type", "application/octet-stream")
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command == "HEAD":
            self._record(status, 0, path)
            return
        with self.hub._lock:
            # a one-off fault is spent on the first GET it can affect (a range request that
            # does not reach it leaves it for the next one)
            drop = self.hub._drops.get(path)
            if drop is not None and drop < len(body):
                del self.hub._drops[path]
            else:
                drop = self.hub._always_drop.get(path)
            flip = self.hub._flips.get(path)
            if flip is not None and start <= flip <= end:
                del self.hub._flips[path]
            else:
                flip = None
            rate = self.hub._trickles.get(path, 0)
        if flip is not None:
            body = bytearray(body)
            body[flip - start] ^= 0xFF
            body = bytes(body)
        if drop is not None:
            part = body[:drop]
            self.wfile.write(part)
            self.wfile.flush()
            self._record(status, len(part), path)
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        if rate:
            step = max(1, rate // 10)
            try:
                for i in range(0, len(body), step):
                    self.wfile.write(body[i:i + step])
                    self.wfile.flush()
                    time.sleep(0.1)
            except OSError:     # the client gave up
                pass
            self._record(status, len(body), path)
            return
        self.wfile.write(body)
        self._record(status, len(body), path)
