"""Redis gone for good: every actor stops by itself once Redis has not answered
for its ``--redis-outage-limit-s`` (here 3 s, through the environment as a
supervisor would set it), with exit status 3 and a log line that says why;
the worker's engine process goes with it. (A Redis back within the limit is
ridden out: ``test_redis_restarted.py``.)"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from shared.redis_outage import EXIT_REDIS_GONE
from tests.conftest import descendants
from tests.faults.cluster import Cluster

LIMIT_S = 3.0


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_every_actor_stops_by_itself_when_redis_is_gone_for_good(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORCAPOD_REDIS_OUTAGE_LIMIT_S", str(LIMIT_S))
    cluster.start_service()
    actors = {name: cluster.processes[name] for name in ("scheduler", "w0", "g0")}
    engines = [pid for pid, _ in descendants(actors["w0"].pid)]
    assert engines, "the worker runs its engine in a process of its own"
    cluster.kill("redis")
    gone_at = time.monotonic()
    for name, process in actors.items():
        assert process.wait(timeout=30) == EXIT_REDIS_GONE, name
        [line] = cluster.log_events(name, "redis_gone_for_good")
        assert line["limit_s"] == LIMIT_S and line["outage_s"] >= LIMIT_S, line
        # Not before the limit: the outage is measured from the first unanswered PING.
        assert time.monotonic() - gone_at >= LIMIT_S, name
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in engines):
        assert time.monotonic() < deadline, [pid for pid in engines if _alive(pid)]
        time.sleep(0.1)
