"""Fetching the images a request names by URL, only where the operator allows it.

vLLM fetches any ``http(s)`` URL unless ``--allowed-media-domains`` narrows it; pagoda fetches
nothing unless told: ``--allowed-media-domains`` lists the hosts it may fetch from (each
redirect's target checked too, at most 5 redirects), ``--allowed-local-media-path`` the
folder ``file://`` URLs may read from (the real path, links resolved). A body is read up to
the image byte limit within one deadline for the whole fetch (a slow server times out), and
every failure is an ImageError naming the part.
"""

from __future__ import annotations

import os
import time
import urllib.parse

import httpx
from PIL import Image

from pagoda.multimodal.images import decode_image
from pagoda.multimodal.inputs import ImageError, MultiModalLimits

MAX_REDIRECTS = 5


class MediaFetcher:
    def __init__(self, allowed_domains: tuple[str, ...] = (), allowed_local_path: str | None = None,
                 limits: MultiModalLimits = MultiModalLimits(), timeout: float = 10.0) -> None:  # fmt: skip
        self.allowed_domains = frozenset(d.lower().rstrip(".") for d in allowed_domains)
        self.allowed_local_path = os.path.realpath(allowed_local_path) if allowed_local_path else None
        self.limits = limits
        self.timeout = timeout

    def __call__(self, url: str, where: str) -> Image.Image:
        scheme = urllib.parse.urlsplit(url).scheme.lower()
        if scheme in ("http", "https"):
            return decode_image(self._http(url, where), where, self.limits)
        if scheme == "file":
            return decode_image(self._file(url, where), where, self.limits)
        raise ImageError(f"{where}: URLs of scheme {scheme or '(none)'!r} are not fetched; send a data URL, an "
                         "http(s) URL of an allowed host or a file:// URL under the allowed path", where)

    def _check_host(self, url: str, where: str) -> None:
        host = (urllib.parse.urlsplit(url).hostname or "").lower().rstrip(".")
        if not self.allowed_domains:
            raise ImageError(f"{where}: this server fetches no image URLs (start it with --allowed-media-domains "
                             "to allow hosts); send the image as a base64 data URL", where)
        if host not in self.allowed_domains:
            raise ImageError(f"{where}: the host {host!r} is not in --allowed-media-domains", where)

    def _http(self, url: str, where: str) -> bytes:
        deadline = time.monotonic() + self.timeout
        limit = self.limits.max_image_bytes
        with httpx.Client(follow_redirects=False, timeout=self.timeout, trust_env=False) as client:
            for _ in range(MAX_REDIRECTS + 1):
                self._check_host(url, where)
                try:
                    with client.stream("GET", url) as r:
                        if r.is_redirect:
                            url = str(r.url.join(r.headers.get("location", "")))
                            continue
                        if r.status_code != 200:
                            raise ImageError(f"{where}: fetching the image answered HTTP {r.status_code}", where)
                        declared = r.headers.get("content-length")
                        if declared is not None and declared.isdigit() and int(declared) > limit:
                            raise ImageError(f"{where}: the image is {declared} bytes; the limit is {limit}", where)
                        body = bytearray()
                        for chunk in r.iter_bytes():
                            body += chunk
                            if len(body) > limit:
                                raise ImageError(f"{where}: the image is over the limit of {limit} bytes", where)
                            if time.monotonic() > deadline:
                                raise ImageError(f"{where}: fetching the image took over {self.timeout:g} s", where)
                        return bytes(body)
                except httpx.TimeoutException:
                    raise ImageError(f"{where}: fetching the image took over {self.timeout:g} s", where) from None
                except httpx.HTTPError as e:
                    raise ImageError(f"{where}: the image could not be fetched ({type(e).__name__})", where) from None
        raise ImageError(f"{where}: more than {MAX_REDIRECTS} redirects", where)

    def _file(self, url: str, where: str) -> bytes:
        if self.allowed_local_path is None:
            raise ImageError(f"{where}: file:// URLs are not read (start the server with --allowed-local-media-path)",
                             where)
        parts = urllib.parse.urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise ImageError(f"{where}: a file:// URL must name a local path", where)
        path = os.path.realpath(urllib.parse.unquote(parts.path))
        if os.path.commonpath([path, self.allowed_local_path]) != self.allowed_local_path:
            raise ImageError(f"{where}: {path} is outside --allowed-local-media-path", where)
        try:
            size = os.path.getsize(path)
            if size > self.limits.max_image_bytes:
                raise ImageError(f"{where}: the image is {size} bytes; the limit is {self.limits.max_image_bytes}",
                                 where)
            with open(path, "rb") as f:
                return f.read(self.limits.max_image_bytes + 1)
        except OSError as e:
            raise ImageError(f"{where}: the file could not be read ({e.strerror})", where) from None
