"""Image URLs fetched only where allowed, against a local HTTP server: an allowed host, a
refused host, a redirect to a refused host, a slow body, an oversized body (declared and
not), an HTTP error; file:// URLs only under the allowed folder, links resolved."""

from __future__ import annotations

import http.server
import io
import os
import threading
import time

import pytest

from pagoda.multimodal.fetch import MediaFetcher
from pagoda.multimodal.inputs import ImageError, MultiModalLimits
from tests.multimodal.checkpoints import random_image


def _png() -> bytes:
    buf = io.BytesIO()
    random_image(12, 9).save(buf, format="PNG")
    return buf.getvalue()


PNG = _png()


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        port = self.server.server_address[1]
        if self.path == "/ok.png":
            self._send(200, PNG)
        elif self.path == "/hop":
            self._redirect("/ok.png")
        elif self.path == "/away":
            self._redirect(f"http://localhost:{port}/ok.png")
        elif self.path == "/loop":
            self._redirect("/loop")
        elif self.path == "/missing":
            self._send(404, b"no")
        elif self.path == "/declared-big":
            self.send_response(200)
            self.send_header("Content-Length", str(10**9))
            self.end_headers()
        elif self.path == "/endless":
            self.send_response(200)
            self.end_headers()
            try:
                for _ in range(2000):
                    self.wfile.write(b"\0" * 1024)
            except OSError:
                pass
        elif self.path == "/slow":
            self.send_response(200)
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            try:
                for b in PNG:
                    self.wfile.write(bytes([b]))
                    self.wfile.flush()
                    time.sleep(0.05)
            except OSError:
                pass

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, to: str) -> None:
        self.send_response(302)
        self.send_header("Location", to)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture(scope="module")
def site():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_allowed_host_and_its_redirects(site):
    fetch = MediaFetcher(("127.0.0.1",), timeout=5)
    assert fetch(f"{site}/ok.png", "p").size == (12, 9)
    assert fetch(f"{site}/hop", "p").size == (12, 9)


@pytest.mark.parametrize("path, says", [
    ("/away", "'localhost' is not in --allowed-media-domains"),
    ("/loop", "more than 5 redirects"),
    ("/missing", "HTTP 404"),
    ("/declared-big", "the limit is 100000"),
    ("/endless", "over the limit of 100000 bytes"),
    ("/slow", "took over 1 s"),
])  # fmt: skip
def test_refused_and_failed_fetches_name_the_part(site, path, says):
    fetch = MediaFetcher(("127.0.0.1",), limits=MultiModalLimits(max_image_bytes=100_000), timeout=1)
    start = time.monotonic()
    with pytest.raises(ImageError, match=says) as e:
        fetch(f"{site}{path}", "messages.[0].content.[0]")
    assert e.value.param == "messages.[0].content.[0]"
    assert time.monotonic() - start < 5


def test_nothing_is_fetched_without_the_list(site):
    with pytest.raises(ImageError, match="fetches no image URLs"):
        MediaFetcher()(f"{site}/ok.png", "p")
    with pytest.raises(ImageError, match="not in --allowed-media-domains"):
        MediaFetcher(("example.com",))(f"{site}/ok.png", "p")
    with pytest.raises(ImageError, match="scheme 'ftp'"):
        MediaFetcher(("127.0.0.1",))("ftp://127.0.0.1/x.png", "p")


def test_local_files_only_under_the_allowed_folder(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    os.symlink(tmp_path / "secret.png", allowed / "link.png")
    fetch = MediaFetcher(allowed_local_path=str(allowed))
    assert fetch(f"file://{allowed}/a.png", "p").size == (12, 9)
    for url in (f"file://{tmp_path}/secret.png", f"file://{allowed}/link.png", f"file://{allowed}/../secret.png"):
        with pytest.raises(ImageError, match="outside --allowed-local-media-path"):
            fetch(url, "p")
    with pytest.raises(ImageError, match="could not be read"):
        fetch(f"file://{allowed}/none.png", "p")
    with pytest.raises(ImageError, match="--allowed-local-media-path"):
        MediaFetcher()(f"file://{allowed}/a.png", "p")
