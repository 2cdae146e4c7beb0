"""Drive the engine with a paced trace: admission, prompt synthesis, and one record per request.

Requests are sent open loop at their due times, except the later turns of a multi-turn session (with
`sessions="closed"`): a turn is sent when the previous turn of its session has finished plus the gap
the trace recorded between the two turns' arrivals (scaled by the replay speed), as a user answers
after reading the reply. Sessions therefore stretch when the engine is slow instead of piling up
turns whose context does not exist yet, and open loop still holds across sessions.

Over 500 lines because admission, session turns, the drain and the per-request record are one request's
lifecycle; their timing rules interlock.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

from soakd.clock import Clock
from soakd.engine.base import Engine, GenerationRequest, SpecSteps, Stamps
from soakd.engine.supervisor import RequestAborted, RequestLost
from soakd.errors import EngineError, HarnessError, SoakdError
from soakd.metric import Sample
from soakd.replay.admission import AdmissionGate
from soakd.replay.pacer import Scheduled
from soakd.replay.prompts import PromptSynth

log = structlog.get_logger(__name__)

INCOMPLETE = "aborted: replay ended"
"""The error of a request the replay's end left unfinished (its status `incomplete`); with " before
admission" when it never left soakd's admission gate."""


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request. Times in seconds; None where the request never got that far."""

    request_id: str
    index: int
    """Position of the request in the trace."""
    loop: int
    """Pass over the trace (0 first)."""
    session: str
    due_wall_ns: int
    """Wall time the trace said the request should be sent."""
    lateness_s: float
    """How late the request was sent against its due time, its admission queueing excepted (harness
    fidelity): when the engine was called, or when its sender process sent it (less any time the engine
    held it before, a restart). 0 if never sent (shed, no prompt, aborted before admission)."""
    turn: int = 0
    """Turn within the session (0 when the request has no session)."""
    copy: int = 0
    """Rate-scale copy of the trace request (0: the request itself)."""
    queue_s: float = 0.0
    """Time waiting for admission (the concurrency ceiling)."""
    ttft_s: float | None = None
    """Send to first output token."""
    tpot_s: float | None = None
    """Mean time per output token after the first: (last - first) / (tokens - 1)."""
    itl_mean_s: float | None = None
    """Mean gap between streamed deltas (a delta may carry several tokens under speculation)."""
    e2e_s: float | None = None
    """Send to last token."""
    ttft_offered_s: float | None = None
    """TTFT as offered: from the due time (after the trace's transforms) to the first output token, the
    admission wait, lateness and connection time included: what the trace's user would have waited."""
    e2e_offered_s: float | None = None
    """E2E as offered: from the due time to the last token."""
    input_tokens: int = 0
    """Prompt tokens sent (after clipping to the engine's context)."""
    input_tokens_trace: int = 0
    """Prompt tokens the trace asked for."""
    output_tokens: int = 0
    """Output tokens received."""
    output_tokens_expected: int = 0
    """Output tokens asked for."""
    spec_accepted: int = 0
    """Draft tokens the engine accepted for this request (per-request speculative metrics)."""
    spec_drafted: int = 0
    """Draft tokens proposed for this request; 0 when the engine does not report them."""
    error: str = ""
    """Empty when the request completed with every token asked for."""
    done: bool = False
    """Set when the record has been counted and handed on (a request is counted exactly once)."""

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def status(self) -> str:
        """The record's `status` tag: ok, shed, incomplete (the run's end cut it: not a failure) or error."""
        if self.ok:
            return "ok"
        if self.error == "shed":
            return "shed"
        return "incomplete" if self.error.startswith(INCOMPLETE) else "error"

    def to_sample(self, time_ns: int) -> Sample:
        status = self.status
        fields: dict[str, float | int | str] = {
            "index": self.index,
            "loop": self.loop,
            "turn": self.turn,
            "lateness_s": self.lateness_s,
            "queue_s": self.queue_s,
            "input_tokens": self.input_tokens,
            "input_tokens_trace": self.input_tokens_trace,
            "output_tokens": self.output_tokens,
            "output_tokens_expected": self.output_tokens_expected,
            "due_ns": self.due_wall_ns,
        }
        for name in ("ttft_s", "tpot_s", "itl_mean_s", "e2e_s", "ttft_offered_s", "e2e_offered_s"):
            value = getattr(self, name)
            if value is not None:
                fields[name] = float(value)
        if self.session:
            fields["session"] = self.session
        if self.copy:
            fields["copy"] = self.copy
        if self.spec_drafted:
            fields["spec_accepted"] = self.spec_accepted
            fields["spec_drafted"] = self.spec_drafted
            fields["spec_acceptance_rate"] = self.spec_accepted / self.spec_drafted
        if self.error:
            fields["error"] = self.error
        return Sample("requests", fields, time_ns, tags={"status": status})


@dataclass(slots=True)
class ReplayStats:
    """Live counters of a replay (read by the progress display and the run summary)."""

    scheduled: int = 0
    """Requests that came due."""
    dispatched: int = 0
    """Requests sent to the engine."""
    completed: int = 0
    """Requests that finished with every token."""
    failed: int = 0
    """Requests that errored, came back short, or were aborted mid-run (an engine rebuild)."""
    incomplete: int = 0
    """Requests the replay's end left unfinished (waiting for admission, or in flight when the drain
    ran out or a second stop signal came): the run's unserved backlog, not failures."""
    shed: int = 0
    """Requests dropped because too many were already waiting for admission."""
    output_tokens: int = 0
    """Output tokens received."""
    clipped: int = 0
    """Requests whose prompt was clipped to fit the engine's context."""
    lateness_max_s: float = 0.0
    """Worst send lateness seen."""
    session_turns: int = 0
    """Later turns sent closed loop, after their session's previous turn finished."""
    session_turns_cut: int = 0
    """Later turns that would have been due after the end of the run (not sent, not counted)."""
    records_lost: int = 0
    """Records that could not be written (e.g. the spool's disk was full); logged, never silent."""
    errors: dict[str, int] = field(default_factory=dict)
    """Error kinds and their counts."""

    @property
    def finished(self) -> int:
        return self.completed + self.failed + self.shed + self.incomplete


RecordSink = Callable[[RequestRecord], None]
DueSink = Callable[[Scheduled], None]
"""Told of each request as it comes due, before it is sent (the crash-resume journal)."""
SpecSink = Callable[[list[int], list[int], int], None]
"""Receives a finished request's per-step accepted and drafted counts, and its turn."""

# A request's prompt is built this long before it is due, then the request waits for its exact time:
# building a long prompt (up to a millisecond or two) must not make it late.
_LEAD_S = 0.005
# An engine with a sender process of its own (EngineInfo.sends_at) gets each request this long before
# it is due, its body encoded, and waits for the exact time itself: a stall of soakd's loop or a thread
# holding the GIL up to this long no longer makes a request late.
_SENDER_LEAD_S = 0.025
# The replay's clock starts this long after run() is called, so the first request, due at trace time 0,
# is built and handed on ahead of its time like every other, first-call costs included (~10-20 ms
# measured: prompt synthesis, encoding, the sender's first frame; the alarm thread's start).
START_S = 0.05
_MAX_SESSIONS = 100_000  # session tails remembered; an evicted session's next turn goes open loop


# Token ids of finished turns kept for their session's next turn, across all sessions (int32: 4 bytes
# each, so 64 MiB); past it the oldest sessions' histories are dropped and their next turn is synthesized.
_HISTORY_TOKENS = 16 * 1024 * 1024


@dataclass(slots=True)
class _Tail:
    """The latest turn of a session: when it was due, when it finished (a future until it has), and
    the tokens the conversation holds after it (its prompt and the engine's answer), once it finished."""

    due_s: float
    done: asyncio.Future[float]
    history: npt.NDArray[np.int32] | None = None


@dataclass(frozen=True, slots=True)
class _Prompt:
    """A due request's prompt as the pacer built it ahead of its send."""

    ids: list[int] | None
    """Its token ids; None for a later turn of a session, whose ids follow the turn before's answer."""


class Replayer:
    """Sends each scheduled request at its due time (open loop) through the admission gate."""

    def __init__(
        self,
        engine: Engine,
        scheduled: Iterable[Scheduled],
        prompts: PromptSynth,
        gate: AdmissionGate,
        clock: Clock,
        on_record: RecordSink,
        *,
        run_tag: str,
        max_pending: int,
        max_model_len: int,
        drain_timeout_s: float,
        duration_s: float | None = None,
        seed: int = 0,
        sessions: str = "closed",
        spec_sink: SpecSink | None = None,
        on_due: DueSink | None = None,
        on_drain: Callable[[], None] | None = None,
    ) -> None:
        self._engine = engine
        self._on_drain = on_drain
        self._on_due = on_due
        self._spec_sink = spec_sink
        self._scheduled = scheduled
        self._prompts = prompts
        self._gate = gate
        self._clock = clock
        self._on_record = on_record
        self._run_tag = run_tag
        self._max_pending = max_pending
        self._max_model_len = max_model_len
        self._drain_timeout_s = drain_timeout_s
        self._duration_s = duration_s
        self._seed = seed
        self._closed_sessions = sessions == "closed"
        self._sessions: OrderedDict[str, _Tail] = OrderedDict()
        self._history_tokens = 0
        self._t0 = 0.0
        self._wall0 = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._queued: dict[int, float] = {}  # id(record) -> since when it waits for admission (its due time)
        self._waiting_turn = 0
        self._late_sum = 0.0
        self._late_n = 0
        self._late_max = 0.0
        self._stop = asyncio.Event()
        self._draining = False
        self._ahead = False
        self._lead = _LEAD_S
        self.stats = ReplayStats()
        self.fatal = ""
        """Why the replay ended early on its own (the engine died, the trace changed); empty if not."""

    def stop(self) -> None:
        """Stop dispatching new requests; those in flight drain as at the normal end."""
        self._stop.set()

    def abort(self) -> None:
        """Stop dispatching and abort the requests in flight now, without waiting for the drain (a second
        stop signal, a stop during the warm-up): each is recorded once, as left unfinished (`incomplete`)."""
        self._stop.set()
        if self._tasks:
            log.warning("replay_aborted", aborting=len(self._tasks))
        for task in list(self._tasks):
            task.cancel()

    @property
    def pending(self) -> int:
        """Requests sent or waiting for admission and not finished."""
        return len(self._tasks)

    @property
    def draining(self) -> bool:
        """The trace is over (or the replay was stopped): no more arrivals, those pending finish."""
        return self._draining

    @property
    def waiting_admission(self) -> int:
        """Requests due and waiting for the concurrency ceiling (not for an earlier turn)."""
        return len(self._queued)

    def head_wait_s(self) -> float:
        """How long the request that has waited longest for the concurrency ceiling has waited so far,
        from its due time (0: none waits): the part of TTFT as offered the queue adds now."""
        if not self._queued:
            return 0.0
        return max(0.0, self._clock.monotonic() - min(self._queued.values()))

    def snapshot(self) -> dict[str, float | int]:
        """Replay state now, and lateness since the last snapshot: the `replay` series.

        When the engine cannot keep up, this is where it shows: requests waiting for admission grow
        and so do queue times, while the pacer keeps the trace's clock (lateness stays small) instead
        of silently stretching the trace.
        """
        st = self.stats
        fields: dict[str, float | int] = {
            "scheduled": st.scheduled,
            "completed": st.completed,
            "failed": st.failed,
            "incomplete": st.incomplete,
            "shed": st.shed,
            "output_tokens": st.output_tokens,
            "pending": len(self._tasks),
            "waiting_admission": len(self._queued),
            "head_wait_s": self.head_wait_s(),
            "waiting_turn": self._waiting_turn,
            "in_engine": self._gate.in_flight,
            "ceiling": self._gate.limit,
            "session_turns": st.session_turns,
        }
        if self._late_n:
            fields["lateness_mean_s"] = self._late_sum / self._late_n
            fields["lateness_max_s"] = self._late_max
            fields["dispatched_interval"] = self._late_n
        self._late_sum = 0.0
        self._late_n = 0
        self._late_max = 0.0
        return fields

    async def run(self) -> ReplayStats:
        self._ahead = self._engine.info.sends_at
        self._lead = _SENDER_LEAD_S if self._ahead else _LEAD_S
        t0 = self._t0 = self._clock.monotonic() + START_S
        wall0 = self._wall0 = self._clock.wall_ns() + int(START_S * 1e9)
        # One precise wait before the first due time: the clock's alarm thread starts now, not on the
        # first request's time.
        await self._clock.sleep_until(self._clock.monotonic() + 0.001)
        stop_wait = asyncio.create_task(self._stop.wait())
        ends_at = t0 + self._duration_s if self._duration_s is not None else None
        try:
            for n, item in enumerate(self._iterate()):
                if self._stop.is_set():
                    break  # stopped before its first request was sent
                if ends_at is not None and self._clock.monotonic() >= ends_at:
                    # Behind schedule at the run's end (an engine or a host that cannot keep the pace):
                    # the requests still owed are not sent after the duration, the run ends on time.
                    break
                deadline = t0 + item.due_s
                due_wall_ns = wall0 + int(item.due_s * 1e9)
                # The pacer builds the prompt ahead, then waits for the exact due time itself (or the
                # engine's sender does): one precise wake per request, and building it is never lateness.
                # The first prompt is built at once: its first-call costs (~10 ms) exceed the pacer's
                # own lead. (Not one handed to a sender: the gate's slot would be held until it is due.)
                early = not n and not self._ahead
                built = self._build(item, deadline, due_wall_ns) if early else None
                if early and built is None:
                    continue
                if self._clock.monotonic() < deadline - self._lead:
                    wake = self._clock.sleep_until(deadline - self._lead, precise=False)
                    sleeper = asyncio.create_task(wake)
                    await asyncio.wait({sleeper, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
                    if not sleeper.done():
                        sleeper.cancel()
                if self._stop.is_set():
                    break
                if not early:
                    built = self._build(item, deadline, due_wall_ns)
                    if built is None:
                        continue
                assert built is not None
                if not self._ahead:
                    await self._clock.sleep_until(deadline)
                    if self._stop.is_set():
                        # Stopped during the exact wait: an abort there has already cancelled what was
                        # in flight, and a request sent now would be one it never saw.
                        break
                self._dispatch(item, deadline, due_wall_ns, built.ids)
            if self._duration_s is not None and not self._stop.is_set():
                # The soak lasts its duration even when the last request is due earlier.
                end = asyncio.create_task(self._clock.sleep_until(t0 + self._duration_s))
                await asyncio.wait({end, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
                end.cancel()
        finally:
            stop_wait.cancel()
            self._draining = True
        if self._on_drain is not None:
            self._on_drain()
        await self._drain()
        return self.stats

    def _build(self, item: Scheduled, deadline: float, due_wall_ns: int) -> _Prompt | None:
        """The prompt of a request that came due; None when none can be made for it: that request's
        failure, recorded, never the soak's."""
        try:
            return _Prompt(None if self._chains(item) else self._prepare(item, None))
        except ValueError as err:
            self._finish(self._record(item, deadline, due_wall_ns), f"prompt: {err}"[:200])
            return None

    def _iterate(self) -> Iterator[Scheduled]:
        """The schedule; an error reading it (a trace changed mid-run) ends the replay, drained."""
        try:
            yield from self._scheduled
        except SoakdError as err:
            self._end(f"trace: {err}")

    def fail(self, reason: str) -> None:
        """End the replay early for a reason found outside it (no engine left); drained as at the end."""
        self._end(reason)

    def _end(self, reason: str) -> None:
        if not self.fatal:
            self.fatal = reason
            log.error("replay_ended_early", reason=reason)
        self._stop.set()

    def _record(self, item: Scheduled, deadline: float, due_wall_ns: int) -> RequestRecord:
        """The record of a request that has come due (counted as scheduled)."""
        stats = self.stats
        stats.scheduled += 1
        if self._on_due is not None:
            self._on_due(item)
        spec = item.spec
        suffix = f"-{spec.copy}" if spec.copy else ""
        return RequestRecord(
            request_id=f"{self._run_tag}-{item.loop}-{spec.index}{suffix}",
            index=spec.index,
            loop=item.loop,
            session=spec.session,
            turn=spec.turn,
            copy=spec.copy,
            due_wall_ns=due_wall_ns,
            lateness_s=0.0,  # set when it is sent
            input_tokens_trace=spec.input_tokens,
            output_tokens_expected=spec.output_tokens,
        )

    def _note_late(self, lateness: float) -> None:
        stats = self.stats
        stats.lateness_max_s = max(stats.lateness_max_s, lateness)
        self._late_sum += lateness
        self._late_n += 1
        self._late_max = max(self._late_max, lateness)

    def _chains(self, item: Scheduled) -> bool:
        """Whether the request is a later turn that waits for its session's previous turn."""
        return (
            self._closed_sessions
            and bool(item.spec.session)
            and f"{item.loop}/{item.spec.session}" in self._sessions
        )

    def _dispatch(self, item: Scheduled, deadline: float, due_wall_ns: int, ids: list[int] | None) -> None:
        done: asyncio.Future[float] | None = None
        if self._closed_sessions and item.spec.session:
            key = f"{item.loop}/{item.spec.session}"
            prev = self._sessions.get(key)
            done = asyncio.get_running_loop().create_future()
            tail = _Tail(item.due_s, done)
            self._sessions[key] = tail
            self._sessions.move_to_end(key)
            if len(self._sessions) > _MAX_SESSIONS:
                _, evicted = self._sessions.popitem(last=False)
                self._drop_history(evicted)
            if prev is not None:
                self._start(self._chained(item, prev, tail), done)
                return
        else:
            tail = None
        if len(self._tasks) >= self._max_pending:
            # Open loop: the trace does not wait for a slow engine, but memory must stay bounded.
            self._finish(self._record(item, deadline, due_wall_ns), "shed")
            if done is not None:
                done.set_result(self._clock.monotonic())
            return
        assert ids is not None
        self._start(self._one(item, self._record(item, deadline, due_wall_ns), ids, tail, deadline), done)

    async def _timed(
        self,
        item: Scheduled,
        deadline: float,
        due_wall_ns: int,
        tail: _Tail | None,
        history: npt.NDArray[np.int32] | None = None,
    ) -> None:
        """A later turn: build the prompt ahead, wait for the exact due time, then admission and send."""
        try:
            ids = self._prepare(item, history)
            if not self._ahead:
                await self._clock.sleep_until(deadline)
        except asyncio.CancelledError:
            self._finish(self._record(item, deadline, due_wall_ns), f"{INCOMPLETE} before admission")
            raise
        except ValueError as err:
            self._finish(self._record(item, deadline, due_wall_ns), f"prompt: {err}"[:200])
            return
        await self._one(item, self._record(item, deadline, due_wall_ns), ids, tail, deadline)

    def _start(self, work: Coroutine[Any, Any, None], done: asyncio.Future[float] | None) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if done is not None:
            # Whatever ends the request (done, failed, aborted), its session's next turn may go.
            clock = self._clock

            def release(_: asyncio.Task[None]) -> None:
                if not done.done():
                    done.set_result(clock.monotonic())

            task.add_done_callback(release)

    def _drop_history(self, tail: _Tail) -> None:
        if tail.history is not None:
            self._history_tokens -= len(tail.history)
            tail.history = None

    def _keep_history(self, tail: _Tail, history: npt.NDArray[np.int32]) -> None:
        """Keep a finished turn's tokens for the next turn, within the global token budget."""
        self._drop_history(tail)
        tail.history = history
        self._history_tokens += len(history)
        for other in self._sessions.values():  # oldest first
            if self._history_tokens <= _HISTORY_TOKENS:
                break
            if other is not tail:
                self._drop_history(other)

    async def _chained(self, item: Scheduled, prev: _Tail, tail: _Tail) -> None:
        """A later turn: wait for the previous turn to finish, then for the recorded gap."""
        gap = max(0.0, item.due_s - prev.due_s)
        self._waiting_turn += 1
        try:
            finished = await asyncio.shield(prev.done)
        finally:
            self._waiting_turn -= 1
        deadline = finished + gap
        end = self._t0 + self._duration_s if self._duration_s is not None else None
        if self._stop.is_set() or (end is not None and deadline >= end):
            self.stats.session_turns_cut += 1
            return
        wake = deadline - self._lead
        if self._clock.monotonic() < wake:
            sleeper = asyncio.create_task(self._clock.sleep_until(wake))
            stopper = asyncio.create_task(self._stop.wait())
            await asyncio.wait({sleeper, stopper}, return_when=asyncio.FIRST_COMPLETED)
            sleeper.cancel()
            stopper.cancel()
            if self._stop.is_set():
                self.stats.session_turns_cut += 1
                return
        self.stats.session_turns += 1
        history = prev.history
        self._drop_history(prev)  # this turn's own history supersedes it
        due_wall_ns = self._wall0 + int((deadline - self._t0) * 1e9)
        await self._timed(item, deadline, due_wall_ns, tail, history)

    async def _one(
        self, item: Scheduled, record: RequestRecord, ids: list[int], tail: _Tail | None, deadline: float
    ) -> None:
        clock = self._clock
        t_wait = clock.monotonic()
        self._queued[id(record)] = max(t_wait, deadline)
        try:
            await self._gate.acquire()
        except asyncio.CancelledError:
            # Its wait at the gate until the end is the backlog's: kept, not zeroed.
            record.queue_s = max(0.0, clock.monotonic() - max(t_wait, deadline))
            self._finish(record, f"{INCOMPLETE} before admission")
            raise
        finally:
            del self._queued[id(record)]
        try:
            # From its due time: a request handed to a sender ahead of time has not queued before it.
            record.queue_s = max(0.0, clock.monotonic() - max(t_wait, deadline))
            await self._send(item, record, ids, tail, deadline)
        except asyncio.CancelledError:
            self._finish(record, INCOMPLETE)
            raise
        except RequestAborted as err:
            self._finish(record, f"aborted: {err}"[:200])
        except RequestLost as err:
            self._finish(record, str(err)[:200])
        except HarnessError as err:
            # soakd's own sender cannot be kept running: nothing more can be sent.
            self._finish(record, f"harness: {err}"[:200])
            self._end(f"harness: {err}")
        except EngineError as err:
            # The engine itself is gone: every later request would fail too, so the soak ends here.
            self._finish(record, f"engine: {err}"[:200])
            self._end(f"engine: {err}")
        # A failed request is a recorded result, never the end of the soak: this is the boundary
        # that contains whatever the engine raises for one request.
        except Exception as err:  # noqa: BLE001
            self._finish(record, f"engine: {type(err).__name__}: {err}"[:200])
        finally:
            await self._gate.release()

    def _prepare(self, item: Scheduled, history: npt.NDArray[np.int32] | None) -> list[int]:
        """The prompt token ids of a request, clipped to leave room for its output."""
        spec = item.spec
        out_tokens = min(spec.output_tokens, self._max_model_len - 1)
        room = self._max_model_len - out_tokens
        if spec.input_tokens > room:
            self.stats.clipped += 1
        # Each loop and each rate-scale copy is its own traffic: salted apart, prefixes shared within.
        ids = self._prompts.prompt_ids(spec, salt=item.loop + (spec.copy << 32), limit=room)
        if history is not None:
            # A later turn carries the conversation as it really went: the previous prompt and the
            # answer the engine gave, whose KV blocks the prefix cache holds, as in a live chat. The
            # trace's length is kept; only the part the history covers is replaced.
            n = min(len(history), len(ids))
            ids[:n] = history[:n].tolist()
        return ids

    async def _send(
        self, item: Scheduled, record: RequestRecord, ids: list[int], tail: _Tail | None, deadline: float
    ) -> None:
        spec = item.spec
        out_tokens = min(spec.output_tokens, self._max_model_len - 1)
        record.output_tokens_expected = out_tokens
        record.input_tokens = len(ids)
        request = self._request(item, record, ids, tail is not None, deadline, out_tokens)
        clock = self._clock
        self.stats.dispatched += 1
        sent = clock.monotonic()
        if not self._ahead:
            # When the engine is called: the pacer's hand-off plus the task's start, queueing excepted.
            record.lateness_s = max(0.0, sent - deadline - record.queue_s)
            self._note_late(record.lateness_s)
        first: float | None = None
        last = sent
        gaps = 0.0
        deltas = 0
        received = 0
        reported = 0
        try:
            async for n in self._engine.generate(request):
                now = clock.monotonic()
                if first is None:
                    first = now
                else:
                    gaps += now - last
                    deltas += 1
                last = now
                reported += n
                # More tokens than max_tokens is not physical (a server's usage gone wrong): only what
                # could have been generated enters the accounting, and the request fails below.
                counted = max(0, min(n, out_tokens - received))
                received += counted
                self.stats.output_tokens += counted
        finally:
            record.output_tokens = received
            # Known once it ended, failed or not (a sender's stamps come with its end).
            stamped = self._stamped_lateness(request, record, deadline)
        if stamped is not None:
            # Stamped where the stream was read, free of soakd's own loop; the send measured from when
            # the engine let it go (held through a restart, it is the engine's downtime, in its TTFT).
            sent, first, last, gaps, deltas = stamped
        if request.spec is not None and request.spec.drafted:
            record.spec_accepted = sum(request.spec.accepted)
            record.spec_drafted = sum(request.spec.drafted)
            if self._spec_sink is not None:
                self._spec_sink(request.spec.accepted, request.spec.drafted, spec.turn)
        if tail is not None and request.output_ids and len(request.output_ids) == received:
            # An engine that does not report token ids leaves the list empty: the next turn is then
            # synthesized from the trace alone.
            self._keep_history(tail, np.array(ids + request.output_ids, dtype=np.int32))
        if first is not None:
            record.ttft_s = first - sent
            record.e2e_s = last - sent
            # From the due time, as the trace's user waited: soakd's own admission gate included (a
            # client-side queue left out of the figure is coordinated omission). Never less than the
            # server's view: a send stamped a hair before its due time is not a head start.
            record.ttft_offered_s = max(record.ttft_s, first - deadline)
            record.e2e_offered_s = max(record.e2e_s, last - deadline)
            if received > 1:
                record.tpot_s = (last - first) / (received - 1)
            if deltas:
                record.itl_mean_s = gaps / deltas
        if reported > out_tokens:
            self._finish(
                record,
                f"implausible output: {reported} tokens reported for max_tokens {out_tokens}",
            )
        elif received < out_tokens:
            self._finish(record, f"short output: {received} of {out_tokens} tokens")
        else:
            self._finish(record, "")

    def _request(
        self,
        item: Scheduled,
        record: RequestRecord,
        ids: list[int],
        turn_of_session: bool,
        deadline: float,
        out_tokens: int,
    ) -> GenerationRequest:
        spec = item.spec
        return GenerationRequest(
            request_id=record.request_id,
            prompt_ids=ids,
            max_tokens=out_tokens,
            seed=self._seed + spec.index,
            temperature=_sampling(spec.sampling, "temperature"),
            top_p=_sampling(spec.sampling, "top_p"),
            # Only a session turn needs its answer's tokens (for the next turn's prompt).
            output_ids=[] if turn_of_session else None,
            spec=SpecSteps() if self._spec_sink is not None else None,
            # Ahead of time: the engine's sender waits for the due time (or sends at once when admission
            # held the request past it).
            send_at=max(deadline, self._clock.monotonic()) if self._ahead else None,
            stamps=Stamps() if self._ahead else None,
        )

    def _stamped_lateness(
        self, request: GenerationRequest, record: RequestRecord, deadline: float
    ) -> tuple[float, float | None, float, float, int] | None:
        """For a request a sender sent: note its lateness, and return (the send as the replay counts it,
        first, last, gaps, deltas) from its stamps; None when it was not stamped."""
        stamps = request.stamps
        if stamps is None or stamps.sent is None or request.send_at is None:
            return None
        # Held before the engine got it (its restart or rebuild under way): not lateness.
        hold = max(0.0, (stamps.handed or request.send_at) - request.send_at)
        # Late until its first bytes left: a connection opened for it counts (the server saw it that
        # late); its TTFT still runs from the send, as a client's does.
        left = stamps.written if stamps.written is not None else stamps.sent
        # From its due time, less its wait at admission (its own figure, `queue_s`): a request soakd
        # handed on after its due time (its loop or its prompt held up past the sender's lead) has a
        # `send_at` as late, but the server saw all of that wait.
        record.lateness_s = max(0.0, left - deadline - record.queue_s - hold)
        self._note_late(record.lateness_s)
        sent = stamps.sent - hold
        return sent, stamps.first, stamps.last or stamps.sent, stamps.gaps, stamps.deltas

    def _finish(self, record: RequestRecord, error: str) -> None:
        """Count the request and hand its record on; never raises, so a request is counted once."""
        if record.done:
            return
        record.done = True
        record.error = error
        stats = self.stats
        if not error:
            stats.completed += 1
        elif error == "shed":
            stats.shed += 1
        elif error.startswith(INCOMPLETE):
            stats.incomplete += 1
        else:
            stats.failed += 1
            kind = error.split(":", 1)[0]
            stats.errors[kind] = stats.errors.get(kind, 0) + 1
        try:
            self._on_record(record)
        except (OSError, ValueError) as err:
            stats.records_lost += 1
            if stats.records_lost == 1 or stats.records_lost % 1000 == 0:
                log.error("record_not_written", error=str(err), lost=stats.records_lost)

    async def _drain(self) -> None:
        if not self._tasks:
            return
        _, still = await asyncio.wait(set(self._tasks), timeout=self._drain_timeout_s)
        if still:
            log.warning("drain_timeout", aborting=len(still), timeout_s=self._drain_timeout_s)
            for task in still:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*still, return_exceptions=True)


def _sampling(params: tuple[tuple[str, float], ...], name: str) -> float | None:
    """A recorded sampling parameter of a request, or None when the trace has none."""
    for key, value in params:
        if key == name:
            return value
    return None
