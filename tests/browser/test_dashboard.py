"""API keys in the browser and the dashboard (`/dashboard`), in chromium against
a real ``orcapod up`` with a tenants file: both pages say plainly that a key
is needed, work once it is entered (and keep it), and the dashboard shows
each worker's iterations and the tenants (the others' names hidden) while
requests run, with the step time's axis fitted to the steps, and keeps an
idle tenant's line; a crafted feed checks the escaping, the banners, the
axis's numbers and the bound on idle tenants kept."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, WebSocketRoute, expect
from websockets.sync.client import connect

from gateway.tenants import hash_key
from tests.browser.conftest import record_banner, start_up
from tests.conftest import descendants
from tests.up_process import UpProcess

pytestmark = pytest.mark.model

KEYS = {"alice": "key-alice", "bob": "key-bob"}
FINISHED = re.compile("^(stop|length)$")


@pytest.fixture(scope="module")
def service(
    browser: Browser, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[UpProcess, int]]:
    tenants: Path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    tenants.write_text(
        "".join(
            f'[tenants.{name}]\nkey_sha256 = ["{hash_key(key)}"]\n' for name, key in KEYS.items()
        )
    )
    up, port = start_up(["--tenants-file", str(tenants)])
    yield up, port
    up.stop()


@pytest.fixture
def port(service: tuple[UpProcess, int]) -> int:
    return service[1]


def enter_key(page: Page, key: str) -> None:
    page.fill("#api-key", key)
    page.press("#api-key", "Tab")  # a change event: the page keeps the key and reconnects


def test_the_chat_page_needs_a_key_says_so_and_keeps_it(page: Page, port: int) -> None:
    page.goto(f"http://127.0.0.1:{port}/")
    banner = page.locator("#banner")
    expect(banner).to_contain_text("needs an API key (HTTP 401")
    expect(page.locator("#api-key")).to_be_visible()  # the settings opened by themselves
    enter_key(page, "not-a-key")
    expect(banner).to_contain_text("The API key was refused (HTTP 401")

    enter_key(page, KEYS["alice"])
    expect(banner).to_be_hidden()
    page.fill("#max-tokens", "16")
    page.fill("#prompt", "Say hello.")
    page.press("#prompt", "Enter")
    answer = page.locator("article.assistant").last
    expect(answer).to_have_attribute("data-finish", FINISHED)
    expect(answer.locator(".text")).not_to_be_empty()

    page.reload()  # the key stays in localStorage
    expect(page.locator("#api-key")).to_have_value(KEYS["alice"])
    page.wait_for_function("() => !document.querySelector('#banner').textContent")
    expect(banner).to_be_hidden()


def run_requests(port: int, num_per_tenant: int, max_tokens: int) -> threading.Thread:
    """Requests of every tenant at once, in a thread, each on its own socket."""

    def one(key: str, index: int) -> None:
        headers = {"Authorization": f"Bearer {key}"}
        with connect(f"ws://127.0.0.1:{port}/ws", additional_headers=headers) as socket:
            frame = {
                "type": "generate",
                "id": f"load-{index}",
                "messages": [{"role": "user", "content": f"Tell story number {index}."}],
                "max_tokens": max_tokens,
                "min_tokens": max_tokens,
            }
            socket.send(json.dumps(frame))
            while json.loads(socket.recv(timeout=60))["type"] not in ("done", "error"):
                pass

    threads = [
        threading.Thread(target=one, args=(key, i * len(KEYS) + j), daemon=True)
        for i in range(num_per_tenant)
        for j, key in enumerate(KEYS.values())
    ]
    for thread in threads:
        thread.start()

    def join_all() -> None:
        for thread in threads:
            thread.join(timeout=120)

    joiner = threading.Thread(target=join_all, daemon=True)
    joiner.start()
    return joiner


def test_the_dashboard_shows_iterations_and_tenants_while_requests_run(
    page: Page, port: int, screenshots: Path
) -> None:
    page.set_viewport_size({"width": 1000, "height": 900})
    page.goto(f"http://127.0.0.1:{port}/dashboard")
    expect(page.locator("#banner")).to_contain_text("needs an API key (HTTP 401")
    enter_key(page, KEYS["alice"])
    load = run_requests(port, num_per_tenant=2, max_tokens=64)

    worker = page.locator("article.worker").first
    expect(worker).to_have_attribute("data-last-step", re.compile(r"^\d+$"))
    first_step = int(str(worker.get_attribute("data-last-step")))
    page.wait_for_function(
        """n => Number(document.querySelector("article.worker").dataset.lastStep) >= n""",
        arg=first_step + 30,
    )
    assert worker.locator(".step:not(.empty)").count() >= 30
    expect(worker.locator(".kv-legend")).to_contain_text("K/V blocks:")
    expect(worker.locator(".caption")).to_contain_text("decode tokens")
    rows = page.locator("#tenants tr")
    expect(rows).to_have_count(2)
    mine = page.locator("#tenants tr.yours")
    expect(mine.locator(".tenant-name")).to_have_text("aliceyou")
    other = rows.filter(has_not=page.locator(".you:visible"))
    assert "bob" not in str(page.locator("#tenants").text_content())
    expect(other).to_have_count(1)
    page.wait_for_function(
        """() => [...document.querySelectorAll("#tenants td:nth-child(2)")]
            .every(cell => Number(cell.textContent.replace(/,/g, "")) > 0)"""
    )
    expect(page.locator("#banner")).to_be_hidden()
    expect(page.locator("#summary")).to_contain_text("policy fair")
    page.screenshot(path=str(screenshots / "dashboard.png"), full_page=True)
    load.join(timeout=120)


def test_the_step_axis_fits_the_steps_and_an_idle_tenant_keeps_its_line(
    page: Page, port: int
) -> None:
    page.goto(f"http://127.0.0.1:{port}/dashboard")
    enter_key(page, KEYS["alice"])
    expect(page.locator("#summary")).to_contain_text("policy fair")
    load = run_requests(port, num_per_tenant=1, max_tokens=16)
    chart = page.locator("#service-chart")
    expect(chart).to_have_attribute("data-num-lines", "2")  # both tenants seen running
    load.join(timeout=120)
    # Both requests done: the feed lists no tenant, and one more snapshot is drawn.
    expect(page.locator("#no-tenants")).to_be_visible()
    idle_since_ms = int(str(page.locator("#view").get_attribute("data-time-ms")))
    page.wait_for_function(
        "t => Number(document.querySelector('#view').dataset.timeMs) > t", arg=idle_since_ms
    )
    expect(page.locator("#tenants tr")).to_have_count(0)
    expect(chart).to_have_attribute("data-num-lines", "2")
    idle = page.locator("#idle-list li")
    expect(idle).to_have_count(2)
    expect(page.locator("#idle-list li:has(.you:visible)")).to_have_attribute(
        "data-tenant", "alice"
    )
    for item in idle.all():
        assert int(str(item.get_attribute("data-num-points"))) >= 1
        expect(item.locator(".since")).to_have_text(re.compile(r"^idle \d+ s$"))

    # One draw's step times (each column's title) beside its axis.
    drawn = page.evaluate(
        r"""() => {
            const worker = document.querySelector("article.worker");
            return {
                stepMs: [...worker.querySelectorAll(".step")]
                    .map(step => / ([\d.]+) ms/.exec(step.title))
                    .filter(Boolean).map(match => Number(match[1])),
                axisMs: Number(worker.querySelector(".y-axis").dataset.maxMs),
                ticks: [...worker.querySelectorAll(".y-axis .tick")].map(t => t.textContent),
                lastStep: worker.dataset.lastStep,
                oldest: worker.querySelector(".x-axis .oldest").textContent,
                newest: worker.querySelector(".x-axis .newest").textContent,
            };
        }"""
    )
    longest_ms = max(drawn["stepMs"])
    axis_ms = drawn["axisMs"]
    assert longest_ms <= axis_ms <= 2 * longest_ms, drawn
    assert [float(tick.removesuffix(" ms").replace(",", "")) for tick in drawn["ticks"]] == [
        pytest.approx(0.0),
        pytest.approx(axis_ms / 2, rel=0.01),
        pytest.approx(axis_ms, rel=0.01),
    ], drawn
    assert drawn["ticks"][-1].endswith(" ms")
    assert re.fullmatch(r"#\d+( · (now|−\d+ s))?", drawn["oldest"]), drawn
    # The newest step came in while the page watched: its age is known.
    assert re.fullmatch(rf"#{drawn['lastStep']} · (now|−\d+ s)", drawn["newest"]), drawn


HOSTILE_NAME = '<img src=x onerror="window.injected = 1"><b>tenant</b>'


def snapshot_frame() -> dict:
    step = {
        "step_index": 7,
        "num_requests": 2,
        "num_prefill_tokens": 30,
        "num_decode_tokens": 1,
        "num_joined": 1,
        "num_left": 0,
        "step_ms": 12.5,
        "path": "<b>eager</b>",
    }
    return {
        "type": "snapshot",
        "time_ms": 1_700_000_000_000,
        "policy": "fair",
        "operator": False,
        "num_waiting": 3,
        "workers": [
            {
                "worker_id": "<i>w</i>",
                "blocks_used": 10,
                "blocks_cached": 5,
                "blocks_total": 100,
                "num_running": 2,
                "steps": [step, {**step, "step_index": 8, "step_ms": None, "path": ""}],
            }
        ],
        "tenants": [
            {
                "tenant": HOSTILE_NAME,
                "you": True,
                "service": 1234.5,
                "num_waiting": 3,
                "num_running": 2,
            }
        ],
    }


def _crafted_feeds(page: Page, port: int) -> list[WebSocketRoute]:
    """The dashboard opened with its feed answered by the test, not the gateway:
    the socket it opened, and each it opens again later (appended)."""
    sockets: list[WebSocketRoute] = []
    page.route_web_socket("**/dashboard/ws", lambda socket: sockets.append(socket))
    page.goto(f"http://127.0.0.1:{port}/dashboard")
    page.wait_for_function("() => document.readyState === 'complete'")
    assert len(sockets) == 1
    return sockets


def test_a_crafted_feed_is_shown_as_text_and_the_banners_say_what_is_wrong(
    page: Page, port: int
) -> None:
    sockets = _crafted_feeds(page, port)
    expect(page.locator("#banner")).to_be_hidden()
    sockets[0].send(json.dumps(snapshot_frame()))
    expect(page.locator("#tenants .tenant-name")).to_have_text(HOSTILE_NAME + "you")
    expect(page.locator("article.worker h3")).to_have_text("<i>w</i>")
    expect(page.locator("article.worker .kv-legend")).to_have_text(
        "K/V blocks: 10 used · 5 cached · 85 free of 100"
    )
    # The newest step with its result in (step 8 still runs), with its path, as text.
    caption = page.locator("article.worker .caption")
    expect(caption).to_contain_text("step #7: 2 requests")
    expect(caption).to_contain_text("12.5 ms on <b>eager</b>")
    assert page.locator("article.worker .step:not(.empty)").count() == 2
    expect(page.locator("#summary")).to_contain_text("3 waiting")
    assert page.locator("#view img, #view b, #view i").count() == 0
    assert page.evaluate("window.injected") is None

    sockets[0].send(json.dumps({"type": "unavailable", "message": "<b>no scheduler</b>"}))
    expect(page.locator("#banner")).to_have_text("No live view: <b>no scheduler</b>")
    expect(page.locator("#view")).to_have_class("view stale")
    sockets[0].send(json.dumps(snapshot_frame()))
    expect(page.locator("#banner")).to_be_hidden()

    record_banner(page)
    sockets[0].close()
    page.wait_for_function("() => window.bannerTexts.some(t => t.includes('reconnecting…'))")
    expect(page.locator("#banner")).to_be_hidden()  # a new socket opened
    assert len(sockets) == 2


def test_a_stopped_scheduler_is_told_and_its_return_noticed(
    page: Page, service: tuple[UpProcess, int]
) -> None:
    up, port = service
    page.goto(f"http://127.0.0.1:{port}/dashboard")
    enter_key(page, KEYS["bob"])
    expect(page.locator("#summary")).to_contain_text("policy fair")
    (scheduler,) = [
        pid for pid, command in descendants(up.process.pid) if "-m scheduler_actor" in command
    ]
    os.kill(scheduler, signal.SIGSTOP)  # it publishes nothing; its live view expires
    try:
        expect(page.locator("#banner")).to_contain_text("No live view: ")
        expect(page.locator("#view")).to_have_class("view stale")
    finally:
        os.kill(scheduler, signal.SIGCONT)
    expect(page.locator("#banner")).to_be_hidden()
    expect(page.locator("#view")).to_have_class("view")


def tenant_frame(time_ms: int, names: list[str], steps: list[dict] | None = None) -> dict:
    """``snapshot_frame()`` at ``time_ms`` listing tenants ``names`` (alice the viewer)."""
    frame = snapshot_frame()
    frame["time_ms"] = time_ms
    if steps is not None:
        frame["workers"][0]["steps"] = steps
    frame["tenants"] = [
        {
            "tenant": name,
            "you": name == "alice",
            "service": 100.0 + i,
            "num_waiting": 0,
            "num_running": 1,
        }
        for i, name in enumerate(names)
    ]
    return frame


def test_a_crafted_feed_gets_a_step_axis_and_idle_tenants_kept_and_bounded(
    page: Page, port: int
) -> None:
    [socket] = _crafted_feeds(page, port)
    t0 = snapshot_frame()["time_ms"]
    worker = page.locator("article.worker")
    chart = page.locator("#service-chart")
    idle = page.locator("#idle-list li")

    socket.send(json.dumps(tenant_frame(t0, ["alice", HOSTILE_NAME])))
    # The longest step is 12.5 ms: the axis goes to the nice 20 ms above it.
    expect(worker.locator(".y-axis")).to_have_attribute("data-max-ms", "20")
    expect(worker.locator(".y-axis .tick")).to_have_text(["0", "10", "20 ms"])
    # Steps already there when the page opened are of unknown age.
    expect(worker.locator(".x-axis .oldest")).to_have_text("#7")
    expect(worker.locator(".x-axis .newest")).to_have_text("#8")
    step = snapshot_frame()["workers"][0]["steps"][0]
    steps = [step, {**step, "step_index": 8, "step_ms": 31.0}, {**step, "step_index": 9}]
    socket.send(json.dumps(tenant_frame(t0 + 250, ["alice", HOSTILE_NAME], steps)))
    expect(worker.locator(".y-axis .tick")).to_have_text(["0", "20", "40 ms"])
    expect(worker.locator(".x-axis .newest")).to_have_text("#9 · now")
    expect(worker.locator(".x-axis .oldest")).to_have_text("#7")

    # The hostile tenant leaves the feed: its line stays, listed as idle, as text.
    socket.send(json.dumps(tenant_frame(t0 + 500, ["alice"], steps)))
    expect(idle).to_have_count(1)
    expect(idle).to_have_attribute("data-tenant", HOSTILE_NAME)
    expect(idle).to_have_attribute("data-num-points", "2")
    expect(chart).to_have_attribute("data-num-lines", "2")
    expect(page.locator("#tenants tr")).to_have_count(1)
    assert page.evaluate("window.injected") is None
    # ... until its last point (t0 + 250) leaves the 2 minutes' window.
    socket.send(json.dumps(tenant_frame(t0 + 120_000, ["alice"], steps)))
    expect(worker.locator(".x-axis .newest")).to_have_text("#9 · −2 min")
    expect(chart).to_have_attribute("data-num-lines", "2")
    socket.send(json.dumps(tenant_frame(t0 + 120_300, ["alice"], steps)))
    expect(chart).to_have_attribute("data-num-lines", "1")
    expect(page.locator("#idle-tenants")).to_be_hidden()

    # 40 tenants each seen once, one after another: the 32 last to go idle stay.
    names = [f"t{i:02}" for i in range(40)]
    for i, name in enumerate([*names, None]):
        listed = ["alice"] if name is None else ["alice", name]
        socket.send(json.dumps(tenant_frame(t0 + 120_550 + 250 * i, listed, steps)))
    expect(page.locator("#view")).to_have_attribute("data-time-ms", str(t0 + 120_550 + 250 * 40))
    expect(chart).to_have_attribute("data-num-lines", "33")
    expect(idle).to_have_count(32)
    assert [item.get_attribute("data-tenant") for item in idle.all()] == names[8:]


def test_a_worker_group_gets_one_row_of_iterations_per_stage(page: Page, port: int) -> None:
    [socket] = _crafted_feeds(page, port)
    frame = snapshot_frame()
    step = frame["workers"][0]["steps"][0]
    frame["workers"][0]["pipeline_depth"] = 2
    frame["workers"][0]["steps"] = [
        {**step, "step_index": 7, "stage_ms": [4.0, 8.0]},
        {**step, "step_index": 8, "stage_ms": [6.0, 2.0]},
        # Still running, and one from a crafted feed with nonsense times: no cells.
        {**step, "step_index": 9, "step_ms": None, "stage_ms": []},
        {**step, "step_index": 10, "stage_ms": ["<b>1</b>", -1]},
    ]
    socket.send(json.dumps(frame))
    rows = page.locator("article.worker .stage-row")
    expect(rows).to_have_count(2)
    expect(page.locator("article.worker .stage-label")).to_have_text(
        ["stage 1 · 5.0 ms", "stage 2 · 5.0 ms"]
    )
    for row, times in zip(rows.all(), [["4.0", "6.0"], ["8.0", "2.0"]], strict=True):
        expect(row).to_have_attribute("data-num-steps", "2")
        cells = row.locator(".stage-cell[data-ms]")
        assert [cell.get_attribute("data-ms") for cell in cells.all()] == times
    # The longest time is the darkest cell.
    darkest = rows.nth(1).locator(".stage-cell[data-ms='8.0']")
    assert darkest.evaluate("cell => getComputedStyle(cell).opacity") == "1"
    # One engine again (a worker that rejoined): no rows shown.
    socket.send(json.dumps(snapshot_frame()))
    expect(page.locator("article.worker .stages")).to_be_hidden()
    assert page.evaluate("window.injected") is None
