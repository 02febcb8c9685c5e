"""The browser tests' fixtures: Debian's chromium driven by Playwright (one
browser for the session; a fresh context, so fresh storage, per test), and
``orcapod up`` for a module."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from tests.conftest import free_port
from tests.up_process import REPO, UpProcess

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DOCS_SCREENSHOTS = REPO / "docs" / "img"
# A run writes the docs' screenshots only when asked (`ORCAPOD_REFRESH_SCREENSHOTS=1
# pytest tests/browser`): otherwise every run would dirty a clean checkout.
REFRESH_SCREENSHOTS = "ORCAPOD_REFRESH_SCREENSHOTS"
# Long enough for a 2-core machine that also runs chromium and the model.
TIMEOUT_MS = 30_000


# Package scope, never session: sync Playwright runs an event loop in the main
# thread while it is open, and every later asyncio.run() would refuse to start.
@pytest.fixture(scope="package")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing (scripts/setup.sh installs Debian's chromium)")
    expect.set_options(timeout=TIMEOUT_MS)
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture(scope="package")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the tests save the pages they show: the docs' folder when
    ``ORCAPOD_REFRESH_SCREENSHOTS=1``, a temporary one otherwise."""
    if os.environ.get(REFRESH_SCREENSHOTS) == "1":
        DOCS_SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        return DOCS_SCREENSHOTS
    return tmp_path_factory.mktemp("screenshots")


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A page in a context of its own (empty localStorage and sessionStorage);
    the test fails if the page throws."""
    context = browser.new_context(viewport={"width": 1000, "height": 720})
    context.set_default_timeout(TIMEOUT_MS)
    opened = context.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda error: errors.append(str(error)))
    yield opened
    context.close()
    assert errors == [], f"the page threw: {errors}"


def start_up(args: Sequence[str] = ()) -> tuple[UpProcess, int]:
    """``orcapod up ARGS`` on a free port with the embedded model, ready."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "ORCAPOD_TENANTS_FILE")}
    up = UpProcess(["--port", str(port), "--worker-arg=--kv-cache-bytes=134217728", *args], env)
    up.wait_ready()
    return up, port


def record_banner(page: Page) -> None:
    """Keep every text the banner shows from now on in ``window.bannerTexts``
    (one may show for less time than a check takes to look)."""
    page.evaluate(
        """() => {
            const banner = document.querySelector("#banner");
            window.bannerTexts = [];
            new MutationObserver(() => window.bannerTexts.push(banner.textContent))
                .observe(banner, {childList: true, characterData: true, subtree: true});
        }"""
    )
