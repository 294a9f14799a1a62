"""A Hugging Face hub on loopback: what ``huggingface_hub`` asks of one for a download, and nothing else.

- ``GET /api/models/{repo}`` and ``.../revision/{rev}`` (``HfApi.model_info(files_metadata=True)``): the
  commit (``sha``) and each file's size and LFS SHA-256 (``siblings``).
- ``HEAD /{repo}/resolve/{rev}/{file}`` (``get_hf_file_metadata``): ``X-Repo-Commit``, ``X-Linked-Etag``
  (the SHA-256, quoted), ``X-Linked-Size``, ``ETag``, ``Content-Length``.
- ``GET`` of the same (``hf_hub_download``): the bytes, from the ``Range: bytes=N-`` asked for (206).
- Errors as the hub says them: 404 with ``X-Error-Code`` ``RepoNotFound`` or ``EntryNotFound``.

A file in ``cut`` is cut once, half-way, with the connection dropped (the client resumes it with a
range); a file in ``corrupt`` is served with one byte changed under the SHA-256 of the true bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

COMMIT = "c0ffee" + "0" * 34
CHUNK = 64 * 1024


class CutConnection(Exception):
    """Raised mid-body: uvicorn drops the connection, as a network cut would."""


@dataclass
class FakeHub:
    repos: dict[str, dict[str, bytes]]
    cut: set[str] = field(default_factory=set)
    corrupt: set[str] = field(default_factory=set)
    requests: list[tuple[str, str, str, str]] = field(default_factory=list)  # method, path, range, auth

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/api/models/{org}/{name}", self.info, methods=["GET"]),
            Route("/api/models/{org}/{name}/revision/{revision}", self.info, methods=["GET"]),
            Route("/{org}/{name}/resolve/{revision}/{path:path}", self.resolve, methods=["GET", "HEAD"]),
        ])

    def _note(self, request: Request) -> None:
        self.requests.append((request.method, request.url.path, request.headers.get("range", ""),
                              request.headers.get("authorization", "")))

    async def info(self, request: Request) -> Response:
        self._note(request)
        repo = f"{request.path_params['org']}/{request.path_params['name']}"
        files = self.repos.get(repo)
        if files is None:
            return _not_found("RepoNotFound", f"Repository {repo} not found")
        siblings = [{"rfilename": name, "size": len(data), "blobId": "0" * 40,
                     "lfs": {"size": len(data), "sha256": _sha(data), "pointerSize": 134}}
                    for name, data in files.items()]
        return JSONResponse({"id": repo, "modelId": repo, "sha": COMMIT, "siblings": siblings})

    async def resolve(self, request: Request) -> Response:
        self._note(request)
        repo = f"{request.path_params['org']}/{request.path_params['name']}"
        name = request.path_params["path"]
        files = self.repos.get(repo)
        if files is None:
            return _not_found("RepoNotFound", f"Repository {repo} not found")
        if name not in files:
            return _not_found("EntryNotFound", f"{name} does not exist on main")
        data = files[name]
        etag = f'"{_sha(data)}"'
        headers = {"X-Repo-Commit": COMMIT, "X-Linked-Etag": etag, "X-Linked-Size": str(len(data)),
                   "ETag": etag, "Accept-Ranges": "bytes"}
        if request.method == "HEAD":
            return Response(headers={**headers, "Content-Length": str(len(data))})
        if name in self.corrupt:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        start = _range_start(request.headers.get("range", ""))
        body = data[start:]
        headers["Content-Length"] = str(len(body))
        status = 200
        if start:
            status = 206
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        cut = name in self.cut
        self.cut.discard(name)
        return StreamingResponse(_chunks(body, cut), status_code=status, headers=headers,
                                 media_type="application/octet-stream")


async def _chunks(body: bytes, cut: bool) -> AsyncIterator[bytes]:
    half = len(body) // 2
    for offset in range(0, len(body), CHUNK):
        if cut and offset >= half:
            raise CutConnection("the fake hub cuts this download half-way, once")
        yield body[offset:offset + CHUNK]


def _range_start(header: str) -> int:
    """The start of ``Range: bytes=N-`` (the only form huggingface_hub sends); 0 without one."""
    if not header.startswith("bytes="):
        return 0
    return int(header.removeprefix("bytes=").split("-", 1)[0] or 0)


def _not_found(code: str, message: str) -> Response:
    return JSONResponse({"error": message}, status_code=404,
                        headers={"X-Error-Code": code, "X-Error-Message": message, "X-Repo-Commit": COMMIT})


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
