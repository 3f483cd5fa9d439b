"""A real headless Chromium for the browser tests: Debian's `chromium` package driven by Playwright.

Playwright's own browser download is never used (`playwright install` needs the internet): the
tests launch the system's Chromium through `executable_path`. scripts/test.sh installs it with
apt-get where it is missing. Without a browser the tests fail, telling how to get one, except on
a machine with no apt-get either, where they skip with a reason that says so.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome-stable", "google-chrome")
# As root in a container Chromium's sandbox cannot start; autoplay without a click lets the
# AudioContext run when a test script (not a person) presses the buttons.
CHROMIUM_ARGS = ["--no-sandbox", "--autoplay-policy=no-user-gesture-required", "--disable-dev-shm-usage"]
# Where the tests leave what a person may want to look at (ignored by git).
ARTIFACTS = ROOT / "results" / "browser"


def chromium_path() -> str:
    """The browser to drive; fails (or, with no apt-get to install one, skips) when there is none."""
    override = os.environ.get("ORPHEUS_CHROMIUM")
    if override:
        if not Path(override).is_file():
            pytest.fail(f"ORPHEUS_CHROMIUM={override} is not a file")
        return override
    for name in CHROMIUM_NAMES:
        if found := shutil.which(name):
            return found
    if shutil.which("apt-get"):
        pytest.fail("no Chromium for the browser tests: `bash scripts/test.sh` installs Debian's `chromium` "
                    "with apt-get (or run `apt-get install chromium`, or set ORPHEUS_CHROMIUM to a Chrome binary)")
    pytest.skip("BROWSER TESTS SKIPPED: no Chromium here and no apt-get to install one; "
                "set ORPHEUS_CHROMIUM to a Chrome or Chromium binary to run them")


def sync_playwright() -> Any:
    try:
        from playwright.sync_api import sync_playwright as start
    except ImportError:
        pytest.fail("the browser tests need Playwright for Python: pip install -e '.[dev]' (no browser download)")
    return start()


@dataclass
class Tab:
    """One page in a fresh browser context, with every console error and uncaught exception it raised."""

    page: Page
    errors: list[str] = field(default_factory=list)
    # Every wait's window is the reference machine's, stretched by this (tests/pace.py: MachinePace.stretch(), capped).
    slowness: float = 1.0

    def window(self, reference_s: float) -> float:
        return reference_s * self.slowness

    def js(self, expression: str) -> Any:
        return self.page.evaluate(expression)

    def wait(self, expression: str, within_s: float, what: str) -> Any:
        """Poll a JavaScript expression until it is truthy; its value.

        Polled through evaluate() rather than Playwright's wait_for_function, which compiles its
        predicate with eval() in the page: the page's Content-Security-Policy forbids that, and
        the tests run under the page's real policy.
        """
        within_s = self.window(within_s)
        deadline = time.monotonic() + within_s
        while True:
            value = self.page.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not true within {within_s:.1f}s ({expression})")
            time.sleep(0.05)

    def snapshot(self) -> dict[str, Any]:
        return self.page.evaluate("window.orpheusPlayground.snapshot()")


def _page_error(message: Any) -> bool:
    """A console error of the page's own doing. Chrome also logs every non-2xx response as one: the server
    panel polls /ready once a second, and its 503 (warming up, saturated on a loaded machine) is that
    endpoint's answer, shown on the page, not a failure."""
    if message.type != "error":
        return False
    url = (message.location or {}).get("url", "")
    return not (url.rstrip("/").endswith("/ready") and "503" in message.text)


def open_tab(browser: Browser, url: str, *, viewport: tuple[int, int] = (1280, 900),
             on_page: Callable[[Page], None] | None = None, slowness: float = 1.0) -> Tab:
    context = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]}, accept_downloads=True)
    page = context.new_page()
    tab = Tab(page, slowness=slowness)
    page.on("console", lambda message: tab.errors.append(message.text) if _page_error(message) else None)
    page.on("pageerror", lambda error: tab.errors.append(f"uncaught: {error}"))
    if on_page is not None:
        on_page(page)
    page.goto(url)
    return tab
