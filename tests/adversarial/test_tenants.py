"""One tenant's abuse costs another nothing; keys and origins are enforced live."""

from __future__ import annotations

import asyncio
import time

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from tests.adversarial.service import INTERNALS, KEYS, Client, Service, open_socket, wait_closed

POLICY_VIOLATION = 1008
# The attacker's requests a round: its max_in_flight (4) + max_queued (16) + 8.
ROUND_REQUESTS = 28


def test_a_flooding_tenant_is_capped_and_the_victim_is_served(service: Service) -> None:
    """The attacker (max_queued 16, max_in_flight 4) submits on sockets it then
    drops: detached requests still count, the excess gets queue_full, and the
    victim's request is served meanwhile."""

    async def flood() -> list[dict[str, object]]:
        refusals = []
        for round_index in range(4):
            async with open_socket(service, "attacker") as socket:
                client = Client(socket)
                # More than max_in_flight + max_queued (20) at once: the excess is
                # refused however fast the worker drains the queue between rounds.
                for i in range(ROUND_REQUESTS):
                    await client.generate(f"f{round_index}.{i}", max_tokens=24, ignore_eos=True)
                # The scheduler's refusals come within a few of its turns; then
                # the socket goes, and its requests stay, detached.
                await client.read_for(2.0)
                refusals += client.errors()
        return refusals

    async def victim() -> float:
        await asyncio.sleep(1.0)
        async with open_socket(service, "victim") as socket:
            started = time.monotonic()
            outcome = await Client(socket).ask("v", max_tokens=8)
            assert outcome.end is not None and outcome.end["type"] == "done", outcome.frames
            return time.monotonic() - started

    async def both() -> tuple[list[dict[str, object]], float]:
        refusals, victim_s = await asyncio.gather(flood(), victim())
        return refusals, victim_s

    refusals, victim_s = asyncio.run(both())
    print(
        f"flood: {len(refusals)} of {4 * ROUND_REQUESTS} refused queue_full; "
        f"victim served in {victim_s:.1f} s"
    )
    assert refusals, f"{4 * ROUND_REQUESTS} requests of a tenant with max_queued 16 all taken"
    assert {r["code"] for r in refusals} == {"queue_full"}
    assert all(not INTERNALS.search(str(r["message"])) for r in refusals)
    assert victim_s < 30.0


def test_a_foreign_origin_is_refused(service: Service) -> None:
    async def handshake(origin: str) -> None:
        headers = {"Authorization": f"Bearer {KEYS['victim']}", "Origin": origin}
        async with connect(service.url, additional_headers=headers, open_timeout=10):
            pass

    with pytest.raises(InvalidStatus) as refused:
        asyncio.run(handshake("http://evil.example"))
    assert refused.value.response.status_code == 403
    asyncio.run(handshake(f"http://127.0.0.1:{service.port}"))


def test_a_revoked_key_closes_its_sockets_and_no_key_never_opens(service: Service) -> None:
    async def revoke() -> int | None:
        async with open_socket(service, "doomed") as socket:
            await Client(socket).ask("before", max_tokens=2)
            service.write_tenants(["victim", "attacker"])
            return await wait_closed(socket, 15)

    async def handshake(key: str | None) -> None:
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        async with connect(service.url, additional_headers=headers, open_timeout=10):
            pass

    try:
        assert asyncio.run(revoke()) == POLICY_VIOLATION
        with pytest.raises(InvalidStatus) as refused:
            asyncio.run(handshake(KEYS["doomed"]))
        assert refused.value.response.status_code == 401
        # Every key gone: the gateway does not turn into an open one.
        service.write_tenants([])
        time.sleep(5)
        with pytest.raises(InvalidStatus) as refused:
            asyncio.run(handshake(None))
        assert refused.value.response.status_code == 401
    finally:
        service.write_tenants(list(KEYS))
        time.sleep(5)
