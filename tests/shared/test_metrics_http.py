"""shared/metrics_http.py: a real aiohttp server on a free port, scraped over HTTP and
parsed with prometheus_client's own text parser."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.parser import text_string_to_metric_families

from shared.metrics_http import metrics_handler, metrics_url, run_with_metrics, serve_metrics


def _registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("orcapod_things", "Things.", ["worker"], registry=registry).labels("w1").inc(3)
    Gauge("orcapod_level", "A level.", registry=registry).set(0.25)
    return registry


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value of every sample in ``text``."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def _get(url: str, accept: str | None = None) -> tuple[int, str, str]:
    headers = {} if accept is None else {"Accept": accept}
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as response:
        return response.status, response.headers["Content-Type"], await response.text()


async def _started(registry: CollectorRegistry, stop: asyncio.Event, tasks: asyncio.TaskGroup):
    """Start ``serve_metrics`` on port 0; its bound port once it listens."""
    bound: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    tasks.create_task(serve_metrics(registry, "127.0.0.1", 0, stop, bound.set_result))
    return await asyncio.wait_for(bound, timeout=5)


def test_a_scrape_returns_the_registry_in_the_text_format() -> None:
    async def main() -> None:
        stop = asyncio.Event()
        async with asyncio.TaskGroup() as tasks:
            port = await _started(_registry(), stop, tasks)
            assert port > 0
            status, content_type, text = await _get(metrics_url("127.0.0.1", port))
            stop.set()
        assert status == 200
        assert content_type.startswith("text/plain; version=0.0.4")
        samples = _samples(text)
        assert samples[("orcapod_things_total", (("worker", "w1"),))] == 3.0
        assert samples[("orcapod_level", ())] == 0.25
        families = {family.name: family.type for family in text_string_to_metric_families(text)}
        assert families["orcapod_things"] == "counter"
        assert families["orcapod_level"] == "gauge"

    asyncio.run(main())


def test_the_format_follows_the_accept_header() -> None:
    async def main() -> None:
        stop = asyncio.Event()
        async with asyncio.TaskGroup() as tasks:
            port = await _started(_registry(), stop, tasks)
            url = metrics_url("127.0.0.1", port)
            _, content_type, text = await _get(url, "application/openmetrics-text; version=1.0.0")
            stop.set()
        assert content_type.startswith("application/openmetrics-text; version=1.0.0")
        assert text.rstrip().endswith("# EOF")

    asyncio.run(main())


def test_each_scrape_sees_the_registry_as_it_is_now() -> None:
    registry = CollectorRegistry()
    gauge = Gauge("orcapod_level", "A level.", registry=registry)

    async def main() -> None:
        stop = asyncio.Event()
        async with asyncio.TaskGroup() as tasks:
            port = await _started(registry, stop, tasks)
            url = metrics_url("127.0.0.1", port)
            gauge.set(1)
            first = _samples((await _get(url))[2])
            gauge.set(7)
            second = _samples((await _get(url))[2])
            stop.set()
        assert first[("orcapod_level", ())] == 1
        assert second[("orcapod_level", ())] == 7

    asyncio.run(main())


def test_stop_closes_the_port() -> None:
    async def main() -> int:
        stop = asyncio.Event()
        async with asyncio.TaskGroup() as tasks:
            port = await _started(_registry(), stop, tasks)
            stop.set()
        return port

    port = asyncio.run(main())
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass


def test_a_port_in_use_is_an_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        async def main() -> None:
            await serve_metrics(_registry(), "127.0.0.1", port, asyncio.Event())

        with pytest.raises(OSError):
            asyncio.run(main())


def test_the_handler_mounts_on_another_app() -> None:
    """How the gateway serves its registry on its own port."""

    async def main() -> str:
        app = web.Application()
        app.router.add_get("/metrics", metrics_handler(_registry()))
        runner = web.AppRunner(app)
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = runner.addresses[0][1]
            return (await _get(f"http://127.0.0.1:{port}/metrics"))[2]
        finally:
            await runner.cleanup()

    assert _samples(asyncio.run(main()))[("orcapod_things_total", (("worker", "w1"),))] == 3.0


def test_run_with_metrics_serves_while_main_runs_and_stops_with_it() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    scraped: list[str] = []

    async def actor() -> None:
        # The actor's own work: here, scrape the server that runs beside it.
        for _ in range(50):
            try:
                scraped.append((await _get(metrics_url("127.0.0.1", port)))[2])
                return
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.05)

    asyncio.run(run_with_metrics(actor(), _registry(), "127.0.0.1", port))
    assert _samples(scraped[0])[("orcapod_level", ())] == 0.25
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass


def test_run_with_metrics_without_a_port_only_runs_main() -> None:
    ran: list[bool] = []

    async def actor() -> None:
        ran.append(True)

    asyncio.run(run_with_metrics(actor(), _registry(), "127.0.0.1", None))
    assert ran == [True]


def test_an_error_of_main_ends_the_server_too() -> None:
    async def actor() -> None:
        await asyncio.sleep(0.05)
        raise RuntimeError("the actor failed")

    with pytest.raises(ExceptionGroup) as caught:
        asyncio.run(run_with_metrics(actor(), _registry(), "127.0.0.1", 0))
    assert caught.group_contains(RuntimeError, match="the actor failed")


def test_metrics_url_brackets_ipv6_hosts() -> None:
    assert metrics_url("127.0.0.1", 9090) == "http://127.0.0.1:9090/metrics"
    assert metrics_url("::1", 9090) == "http://[::1]:9090/metrics"
