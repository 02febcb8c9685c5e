"""Which step-journal entries must stay, and which requests to checkpoint.

The journal (the ``results`` stream: one ``StepOutput`` per step) is the only
record of a token until the scheduler writes it into its request's log (a
checkpoint, ``shared/request_log.py``). So an entry may go only once every
token in it is in its request's log. This keeps, per live request, the
journal entry of its oldest token not yet checkpointed; the journal is
trimmed (XTRIM MINID) to the oldest of those, and a request whose oldest
such token is older than the checkpoint age is checkpointed (once a second,
by the housekeeping), so no running request holds the journal for long.

Pure: entry ids in, decisions out.
"""

from __future__ import annotations

from collections.abc import Iterable

# A stream entry id as Redis orders it: (milliseconds, sequence).
EntryId = tuple[int, int]


def parse_entry_id(entry_id: bytes | str) -> EntryId:
    """``b"<ms>-<seq>"`` as an ordered pair."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def format_entry_id(entry_id: EntryId) -> str:
    """The pair as Redis writes it."""
    return f"{entry_id[0]}-{entry_id[1]}"


class JournalRetention:
    """Per live request: where its tokens not yet in its log begin in the journal,
    and how many of its tokens its log holds."""

    def __init__(self) -> None:
        self._oldest_unlogged: dict[str, EntryId] = {}
        self._num_logged: dict[str, int] = {}
        self._newest_read: EntryId | None = None

    def on_entry(self, entry_id: bytes, request_ids: Iterable[str]) -> None:
        """A journal entry was applied; ``request_ids`` got a token in it that
        their logs do not hold yet."""
        parsed = parse_entry_id(entry_id)
        if self._newest_read is None or parsed > self._newest_read:
            self._newest_read = parsed
        for request_id in request_ids:
            self._oldest_unlogged.setdefault(request_id, parsed)

    def num_logged(self, request_id: str) -> int:
        """Tokens of the request its log holds (as far as this scheduler wrote them)."""
        return self._num_logged.get(request_id, 0)

    def logged(self, request_id: str, num_tokens: int) -> None:
        """The request's first ``num_tokens`` tokens are in its log now."""
        self._oldest_unlogged.pop(request_id, None)
        self._num_logged[request_id] = num_tokens

    def forget(self, request_id: str) -> None:
        """The request ended (its last checkpoint is written) or was never logged."""
        self._oldest_unlogged.pop(request_id, None)
        self._num_logged.pop(request_id, None)

    def due(self, max_age_ms: int) -> list[str]:
        """Requests whose oldest token not in their log is more than ``max_age_ms``
        older than the newest journal entry read (Redis's clock, not ours)."""
        if self._newest_read is None:
            return []
        now_ms = self._newest_read[0]
        return [
            request_id
            for request_id, (ms, _) in self._oldest_unlogged.items()
            if now_ms - ms > max_age_ms
        ]

    def trim_point(self) -> str | None:
        """The oldest journal entry still needed (XTRIM MINID to it), or None
        when nothing was read yet. With nothing unlogged, every entry read so
        far can go."""
        if self._oldest_unlogged:
            return format_entry_id(min(self._oldest_unlogged.values()))
        if self._newest_read is None:
            return None
        ms, seq = self._newest_read
        return format_entry_id((ms, seq + 1))
