"""The documentation site, opened in a real headless Chromium.

Not part of ``make test`` (``tests/``): it needs the ``docs`` extra and Chromium
(Debian: ``apt-get install chromium``). Run it with::

    bash scripts/build_docs.sh && .venv/bin/python -m pytest -q checks/test_site.py

It serves ``site/`` over loopback with ``python -m http.server`` and dumps each page's
DOM after Chromium has loaded it and run its scripts. When ``site/`` has not been built it
builds it with ``scripts/build_docs.sh``; it skips only when it cannot (no MkDocs), and it
fails when Chromium is missing.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "site"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
# the flags a closed network needs: no GPU, no QUIC, no background or update traffic
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
        "track", "wbr"}


class Page(HTMLParser):
    """What the checks read from a dumped DOM: headings, the primary nav's links, the text
    of each ``<code>`` block and of each mkdocstrings object, and the root's classes."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.html_classes: list[str] = []
        self.headings: list[tuple[str, str, str]] = []  # (tag, id, text)
        self.nav_links: list[str] = []
        self.code_blocks: list[str] = []
        self.objects: dict[str, str] = {}  # mkdocstrings heading id -> the object's text
        self._open: list[tuple[str, dict, list[str]]] = []  # tag, attributes, text parts
        self._nav_depth: int | None = None
        self._object: tuple[str, int] | None = None  # (id, depth of its div.doc-object)
        self.feed(html)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = {k: v or "" for k, v in attrs}
        classes = attributes.get("class", "").split()
        if tag == "html":
            self.html_classes = classes
        if tag in VOID:
            return
        self._open.append((tag, attributes, []))
        if tag == "nav" and "md-nav--primary" in classes and self._nav_depth is None:
            self._nav_depth = len(self._open)
        if tag == "div" and "doc-object" in classes and self._object is None:
            self._object = ("", len(self._open))

    def handle_endtag(self, tag: str) -> None:
        if tag in VOID or not any(t == tag for t, _, _ in self._open):
            return
        while self._open:
            name, attributes, parts = self._open.pop()
            text = " ".join("".join(parts).split())
            depth = len(self._open) + 1
            if self._open:  # the parent's text includes its children's
                self._open[-1][2].append("".join(parts))
            if name in {"h1", "h2", "h3", "h4", "h5", "h6"}:
                self.headings.append((name, attributes.get("id", ""), text))
                if self._object is not None and not self._object[0] and attributes.get("id"):
                    self._object = (attributes["id"], self._object[1])
            if name == "a" and self._nav_depth is not None:
                self.nav_links.append(text)
            if name == "code":
                self.code_blocks.append("".join(parts))
            if self._nav_depth == depth:
                self._nav_depth = None
            if self._object is not None and self._object[1] == depth:
                self.objects.setdefault(self._object[0], text)
                self._object = None
            if name == tag:
                break

    def handle_data(self, data: str) -> None:
        if self._open:
            self._open[-1][2].append(data)

    def heading(self, tag: str) -> list[str]:
        """The texts of the headings ``tag``, permalink signs dropped."""
        return [text.rstrip("¶").strip() for t, _, text in self.headings if t == tag]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def site() -> Path:
    """``site/``, built by ``scripts/build_docs.sh`` if it is not there."""
    if not (SITE / "index.html").is_file():
        if importlib.util.find_spec("mkdocs") is None:
            pytest.skip(
                "site/ has not been built and MkDocs is not installed: "
                'pip install -e ".[docs]", then bash scripts/build_docs.sh'
            )
        env = dict(os.environ, PY=sys.executable)
        subprocess.run(["bash", str(ROOT / "scripts" / "build_docs.sh")], cwd=ROOT, env=env,
                       check=True, timeout=600)
    assert (SITE / "index.html").is_file(), "scripts/build_docs.sh did not write site/index.html"
    return SITE


@pytest.fixture(scope="module")
def server(site: Path) -> Iterator[str]:
    """The base URL of ``site/`` served over loopback; the server is stopped at the end."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
         "--directory", str(site)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None, f"http.server exited with {proc.returncode}"
                assert time.monotonic() < deadline, "http.server did not listen within 30 s"
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def browser() -> str:
    """Chromium's path; a missing Chromium fails the check (CI installs it)."""
    found = shutil.which(CHROMIUM)
    if found is None:
        pytest.fail(f"Chromium not found at {CHROMIUM} (Debian: apt-get install -y chromium)")
    return found


@pytest.fixture(scope="module")
def open_page(server: str, browser: str, tmp_path_factory) -> Iterator:
    """``open_page("api/state/")``: the page's DOM after Chromium loaded it, parsed."""
    profile = tmp_path_factory.mktemp("chromium-profile")

    def open_page(path: str) -> Page:
        with tempfile.TemporaryDirectory(dir=profile) as user_data:
            done = subprocess.run(
                [browser, *CHROMIUM_FLAGS, f"--user-data-dir={user_data}", "--dump-dom",
                 server + path],
                capture_output=True, text=True, timeout=120,
            )
        assert done.returncode == 0, f"chromium failed on {path}: {done.stderr[-2000:]}"
        assert "<html" in done.stdout, f"no DOM for {path}: {done.stderr[-2000:]}"
        return Page(done.stdout)

    yield open_page


def test_the_home_page_renders_with_its_heading_and_the_nav(open_page):
    page = open_page("")
    assert page.heading("h1") == ["accordion"]
    # Material's script ran in the browser: it marks the root element
    assert "js" in page.html_classes
    for entry in ("Home", "Which configuration for my model", "The DDP hook", "Examples",
                  "API reference", "Changelog"):
        assert entry in page.nav_links, f"{entry!r} not in the nav: {page.nav_links}"
    assert "Add it to a DDP job" in page.heading("h2")


def test_the_api_page_of_accordion_state_renders_its_signature_and_parameters(open_page):
    page = open_page("api/state/")
    assert page.heading("h1") == ["The hook and its state"]
    assert "AccordionState" in page.heading("h2")
    state = page.objects.get("accordion.AccordionState", "")
    # the signature, from Controller.__init__, and a method with its docstring
    assert "interval_unit" in state and "levels" in state, state[:2000]
    assert "end_epoch" in state
    # the arguments' table, from Controller's Google-style "Args:" section
    controller = page.objects.get("accordion.Controller", "")
    assert "interval_unit" in controller and "how often the rule checks" in controller


def test_an_example_page_renders_its_heading_and_the_examples_code(open_page):
    page = open_page("examples/ddp_hook/")
    assert page.heading("h1") == ["The DDP hook"]
    source = (ROOT / "examples" / "ddp_hook.py").read_text()
    line = next(ln.strip() for ln in source.splitlines() if "AccordionState(" in ln)
    code = "\n".join(page.code_blocks)
    assert line in code, f"{line!r} is not in the page's code"
    assert "torchrun --standalone --nproc-per-node 2 examples/ddp_hook.py" in code
