"""The replayer: open-loop dispatch, admission ceiling, records per request, shedding, draining."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from soakd.clock import FakeClock, SystemClock
from soakd.engine.base import EngineInfo, GenerationRequest
from soakd.errors import HarnessError
from soakd.replay.admission import AdmissionGate
from soakd.replay.pacer import schedule
from soakd.replay.prompts import PromptSynth
from soakd.replay.runner import START_S as START
from soakd.replay.runner import Replayer, RequestRecord
from soakd.traces.model import RequestSpec


class FakeEngine:
    """Streams `max_tokens` tokens in deltas of `chunk`, `step_s` apart on the given clock."""

    def __init__(
        self,
        clock: FakeClock | SystemClock,
        step_s: float = 0.01,
        chunk: int = 2,
        fail_on: set[int] | None = None,
        short_on: set[int] | None = None,
        huge_on: set[int] | None = None,
    ) -> None:
        self.clock = clock
        self.huge_on = huge_on or set()
        self.step_s = step_s
        self.chunk = chunk
        self.fail_on = fail_on or set()
        self.short_on = short_on or set()
        self.requests: list[GenerationRequest] = []
        self.active = 0
        self.peak = 0

    @property
    def info(self) -> EngineInfo:
        return EngineInfo("fake", "0", "m", "cfg", vocab_size=100, reserved_ids=(0,), max_model_len=64)

    async def start(self) -> None:
        return None

    async def generate(self, request: GenerationRequest) -> AsyncIterator[int]:
        self.requests.append(request)
        index = int(request.request_id.rsplit("-", 1)[1])
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            if index in self.fail_on:
                raise RuntimeError("boom")
            left = request.max_tokens - (1 if index in self.short_on else 0)
            if index in self.huge_on:  # a server whose usage reports far more than was asked
                yield 10**15
                return
            while left > 0:
                await self.clock.sleep_until(self.clock.monotonic() + self.step_s)
                n = min(self.chunk, left)
                left -= n
                yield n
        finally:
            self.active -= 1

    def process_ids(self) -> list[int]:
        return []

    async def stop(self) -> None:
        return None


def make(
    engine: FakeEngine,
    specs: list[RequestSpec],
    clock: FakeClock | SystemClock,
    *,
    limit: int = 8,
    max_pending: int = 100,
    duration: float = 1000.0,
    drain: float = 5.0,
) -> tuple[Replayer, list[RequestRecord]]:
    records: list[RequestRecord] = []
    span = specs[-1].arrival_s if specs else 0.0
    sched = schedule(specs, span_s=span, requests=len(specs), speed=1.0, duration_s=duration, loop=False)
    rep = Replayer(
        engine,
        sched,
        PromptSynth(100, 0, (0,)),
        AdmissionGate(limit),
        clock,
        records.append,
        run_tag="t",
        max_pending=max_pending,
        max_model_len=64,
        drain_timeout_s=drain,
        duration_s=duration,
    )
    return rep, records


def spec(i: int, t: float, inp: int = 20, out: int = 6) -> RequestSpec:
    return RequestSpec(i, t, inp, out, 16)


async def test_every_scheduled_request_gets_exactly_one_record() -> None:
    clock = FakeClock(-START)
    engine = FakeEngine(clock, fail_on={2}, short_on={3})
    rep, records = make(engine, [spec(i, i * 0.5) for i in range(6)], clock)
    stats = await rep.run()
    assert sorted(r.index for r in records) == list(range(6))
    assert stats.scheduled == 6 and stats.completed == 4 and stats.failed == 2
    by = {r.index: r for r in records}
    assert by[2].error.startswith("engine: RuntimeError: boom")
    assert by[3].error == "short output: 5 of 6 tokens"
    ok = by[0]
    assert ok.ok and ok.output_tokens == 6 and ok.input_tokens == 20
    # 3 deltas 10 ms apart (virtual time): TTFT 10 ms, TPOT (30-10)/(6-1) ms, ITL 10 ms
    assert ok.ttft_s == pytest.approx(0.01)
    assert ok.e2e_s == pytest.approx(0.03)
    assert ok.tpot_s == pytest.approx(0.004)
    assert ok.itl_mean_s == pytest.approx(0.01)
    assert stats.output_tokens == sum(r.output_tokens for r in records)


async def test_requests_are_sent_on_trace_time_in_virtual_time() -> None:
    clock = FakeClock(-START)
    engine = FakeEngine(clock, step_s=0.001)
    rep, records = make(engine, [spec(0, 0.0), spec(1, 2.0), spec(2, 7.5)], clock, duration=20.0)
    await rep.run()
    assert clock.monotonic() >= 20.0  # the replay lasted its duration, past the last request
    dues = sorted((r.due_wall_ns - records[0].due_wall_ns) / 1e9 for r in records)
    assert dues == [0.0, 2.0, 7.5]
    assert all(r.lateness_s == 0.0 for r in records)


async def test_admission_ceiling_bounds_concurrency_and_queue_time_is_recorded() -> None:
    clock = FakeClock(-START)
    engine = FakeEngine(clock, step_s=1.0, chunk=1)
    rep, records = make(engine, [spec(i, 0.0) for i in range(6)], clock, limit=2)
    await rep.run()
    assert engine.peak == 2
    assert len(records) == 6 and all(r.ok for r in records)
    assert max(r.queue_s for r in records) > 0


async def test_shed_when_too_many_wait_and_recorded() -> None:
    clock = FakeClock(-START)
    engine = FakeEngine(clock, step_s=1.0, chunk=1)
    rep, records = make(engine, [spec(i, 0.0) for i in range(10)], clock, limit=1, max_pending=3)
    stats = await rep.run()
    assert stats.shed == 7
    assert sum(1 for r in records if r.error == "shed") == 7
    assert stats.finished == 10


async def test_prompts_clip_to_context_and_are_counted() -> None:
    clock = FakeClock(-START)
    engine = FakeEngine(clock)
    rep, records = make(engine, [spec(0, 0.0, inp=500, out=10)], clock)
    stats = await rep.run()
    assert stats.clipped == 1
    assert records[0].input_tokens == 54 and records[0].input_tokens_trace == 500
    assert len(engine.requests[0].prompt_ids) == 54


async def test_stop_ends_dispatch_and_drain_timeout_aborts_in_flight() -> None:
    clock = SystemClock()
    engine = FakeEngine(clock, step_s=0.2, chunk=1)
    rep, records = make(engine, [spec(0, 0.0, out=50), spec(1, 30.0)], clock, drain=0.1)
    task = asyncio.create_task(rep.run())
    deadline = asyncio.get_running_loop().time() + 60  # a hang guard only
    while not engine.requests:  # request 0 is sent (the replay's clock starts START after run())
        assert asyncio.get_running_loop().time() < deadline and not task.done()
        await asyncio.sleep(0.01)  # poll interval
    rep.stop()
    stats = await asyncio.wait_for(task, 60)  # a hang guard: the 0.1 s drain, then the abort
    assert stats.scheduled == 1  # the request due at 30 s was never dispatched
    assert len(records) == 1
    assert records[0].error.startswith("aborted")
    # Cut by the run's end, not failed: its own status, in its own counter, out of the failures.
    assert records[0].status == "incomplete" and records[0].to_sample(0).tags["status"] == "incomplete"
    assert (stats.incomplete, stats.failed, stats.errors) == (1, 0, {})
    assert stats.finished == 1


class StopInTheExactWait(FakeClock):
    """Calls `on_wait` as the replayer starts its exact wait for a due time (the trace's clock starts at
    0; the replayer's own first wait, before it, is not one): a stop signal's moment."""

    def __init__(self, start: float) -> None:
        super().__init__(start)
        self.on_wait: Callable[[], None] = lambda: None

    async def sleep_until(self, deadline: float, precise: bool = True) -> None:
        if precise and self.now < deadline and deadline >= 0.0:
            self.on_wait()
        await super().sleep_until(deadline, precise)


@pytest.mark.parametrize("how", ["abort", "stop"])
async def test_a_stop_during_the_exact_wait_sends_nothing_more(how: str) -> None:
    clock = StopInTheExactWait(-START)
    engine = FakeEngine(clock)
    rep, records = make(engine, [spec(0, 0.0), spec(1, 0.0)], clock)
    clock.on_wait = getattr(rep, how)
    stats = await rep.run()
    # The warm-up's case: an abort cancels what is in flight; a request sent after it was never seen by
    # it, and one that never ends held the run for its drain timeout.
    assert engine.requests == [] and records == [] and stats.scheduled == 0


async def test_head_wait_is_how_long_the_oldest_waiting_request_has_waited_from_its_due_time() -> None:
    clock = FakeClock(-START)
    engine = FakeEngine(clock, step_s=1.0, chunk=1)
    # One request at a time: 0 runs 0-6 s; 1 (due at 1 s) and 2 (due at 2 s) wait behind it.
    rep, _ = make(engine, [spec(0, 0.0), spec(1, 1.0), spec(2, 2.0)], clock, limit=1, duration=30.0)
    seen: dict[float, tuple[float, int]] = {}

    async def look() -> None:
        for t in (0.5, 3.0, 6.5, 25.0):
            await clock.sleep_until(t)
            seen[t] = (rep.head_wait_s(), rep.waiting_admission)

    watcher = asyncio.create_task(look())
    await rep.run()
    await watcher
    assert seen[0.5] == (0.0, 0)  # none waits
    assert seen[3.0] == (pytest.approx(2.0), 2)  # request 1, due at 1 s, the older of the two
    assert seen[6.5][1] == 1 and seen[6.5][0] == pytest.approx(4.5)  # 1 admitted at 6 s: 2's wait
    assert seen[25.0] == (0.0, 0)
    assert rep.snapshot()["head_wait_s"] == 0.0


async def test_gate_limit_can_be_lowered_and_raised() -> None:
    gate = AdmissionGate(2)
    await gate.acquire()
    await gate.acquire()
    await gate.set_limit(1)
    waiter = asyncio.create_task(gate.acquire())
    await gate.release()
    await asyncio.sleep(0)
    assert not waiter.done()  # 1 in flight, limit 1
    await gate.set_limit(3)
    await asyncio.wait_for(waiter, 1)
    assert gate.in_flight == 2 and gate.peak_in_flight == 2
    with pytest.raises(ValueError):
        await gate.set_limit(0)


def test_record_sample_fields_and_status_tag() -> None:
    r = RequestRecord("id", 3, 1, "", 10, 0.001, ttft_s=0.5, output_tokens=4, output_tokens_expected=4)
    s = r.to_sample(99)
    assert s.measurement == "requests" and s.tags == {"status": "ok"} and s.time_ns == 99
    assert s.fields["ttft_s"] == 0.5 and "tpot_s" not in s.fields and "error" not in s.fields
    r.error = "shed"
    assert r.to_sample(1).tags == {"status": "shed"}
    r.error = "engine: x"
    assert r.to_sample(1).tags == {"status": "error"} and r.to_sample(1).fields["error"] == "engine: x"


async def test_a_record_that_cannot_be_written_is_counted_once_and_reported() -> None:
    clock = FakeClock(-START)
    engine = FakeEngine(clock)
    written: list[RequestRecord] = []

    def flaky(record: RequestRecord) -> None:
        if record.index == 1:
            raise OSError(28, "No space left on device")
        written.append(record)

    span = 1.0
    sched = schedule(
        [spec(i, i * 0.5) for i in range(3)], span_s=span, requests=3, speed=1.0, duration_s=100, loop=False
    )
    rep = Replayer(
        engine,
        sched,
        PromptSynth(100, 0, (0,)),
        AdmissionGate(4),
        clock,
        flaky,
        run_tag="t",
        max_pending=10,
        max_model_len=64,
        drain_timeout_s=5,
    )
    stats = await rep.run()
    assert stats.completed == 3 and stats.failed == 0  # counted once, as what it was
    assert stats.records_lost == 1 and len(written) == 2


# --- multi-turn sessions ------------------------------------------------------------------------------


class TimedEngine(FakeEngine):
    """A FakeEngine that notes when each request was sent (virtual time)."""

    def __init__(self, clock: FakeClock, **kw: float) -> None:
        super().__init__(clock, **kw)  # type: ignore[arg-type]
        self.sent: dict[str, float] = {}

    async def generate(self, request: GenerationRequest) -> AsyncIterator[int]:
        self.sent[request.request_id] = self.clock.monotonic()
        async for n in super().generate(request):
            yield n


def _session_specs() -> list[RequestSpec]:
    return [
        RequestSpec(0, 0.0, 20, 6, 16, session="a", turn=0),
        RequestSpec(1, 1.0, 30, 6, 16, session="a", turn=1),
        RequestSpec(2, 1.2, 20, 6, 16),
        RequestSpec(3, 1.5, 40, 6, 16, session="a", turn=2),
    ]


async def test_later_turns_wait_for_the_previous_turn_plus_the_recorded_gap() -> None:
    clock = FakeClock(-START)
    engine = TimedEngine(clock, step_s=0.5, chunk=2)  # 6 tokens: 1.5 s per request
    rep, records = make(engine, _session_specs(), clock)
    stats = await rep.run()
    t0 = 0.0
    sent = {k.split("-")[2]: v - t0 for k, v in engine.sent.items()}
    # Turn 0 at 0, done at 1.5; turn 1 at 1.5 + (1.0 - 0.0); done at 4.0; turn 2 at 4.0 + (1.5 - 1.0).
    assert sent["0"] == pytest.approx(0.0)
    assert sent["1"] == pytest.approx(2.5)
    assert sent["3"] == pytest.approx(4.5)
    # The request without a session stays open loop, at its own time.
    assert sent["2"] == pytest.approx(1.2)
    assert stats.session_turns == 2 and stats.completed == 4
    by = {r.index: r for r in records}
    assert [by[i].turn for i in range(4)] == [0, 1, 0, 2]
    # Lateness is against the closed-loop due time, so a faithful chain is on time.
    assert by[1].lateness_s == pytest.approx(0.0) and by[3].lateness_s == pytest.approx(0.0)


async def test_open_sessions_send_every_turn_at_its_recorded_time() -> None:
    clock = FakeClock(-START)
    engine = TimedEngine(clock, step_s=0.5, chunk=2)
    rep, _ = make(engine, _session_specs(), clock)
    rep._closed_sessions = False
    await rep.run()
    sent = sorted(engine.sent.values())
    assert sent == pytest.approx([0.0, 1.0, 1.2, 1.5])


async def test_turns_due_after_the_end_are_cut_not_failed() -> None:
    clock = FakeClock(-START)
    engine = TimedEngine(clock, step_s=0.5, chunk=2)
    rep, records = make(engine, _session_specs(), clock, duration=3.0)
    stats = await rep.run()
    assert stats.session_turns_cut == 1
    assert stats.scheduled == 3 and stats.failed == 0 and len(records) == 3
    assert 3 not in {r.index for r in records}


async def test_a_failed_turn_still_releases_the_next_one() -> None:
    clock = FakeClock(-START)
    engine = TimedEngine(clock, step_s=0.5, chunk=2, fail_on={0})  # type: ignore[arg-type]
    rep, _ = make(engine, _session_specs(), clock)
    stats = await rep.run()
    assert stats.failed == 1 and stats.completed == 3
    assert engine.sent["t-0-1"] == pytest.approx(1.0)  # turn 0 failed at once: next after the 1.0 s gap


async def test_snapshot_shows_the_backlog_when_the_engine_cannot_keep_up() -> None:
    clock = FakeClock(-START)
    engine = FakeEngine(clock, step_s=0.5, chunk=2)  # 6 tokens: 1.5 s each, one at a time
    rep, records = make(engine, [spec(i, i * 0.1) for i in range(6)], clock, limit=1)
    snaps: list[dict[str, float | int]] = []

    draining: list[bool] = []

    async def probe() -> None:
        await clock.sleep_until(0.55)
        snaps.append(rep.snapshot())
        await clock.sleep_until(0.56)
        snaps.append(rep.snapshot())
        draining.append(rep.draining)  # the soak lasts its duration (1,000 s): not draining yet

    assert not rep.draining
    await asyncio.gather(rep.run(), probe())
    assert draining == [False] and rep.draining
    first, second = snaps
    assert first["scheduled"] == 6 and first["in_engine"] == 1 and first["ceiling"] == 1
    assert first["waiting_admission"] == 5 and first["pending"] == 6
    # The pacer kept the trace's clock: the backlog is in admission, not in lateness (one request sent).
    assert first["lateness_max_s"] == pytest.approx(0.0) and first["dispatched_interval"] == 1
    # Lateness is per interval: nothing was dispatched between the two snapshots.
    assert "lateness_max_s" not in second
    assert max(r.queue_s for r in records) == pytest.approx(5 * 1.5 - 0.5)


async def test_latency_as_offered_counts_the_admission_wait_from_the_due_time() -> None:
    # One slot, each request 1.5 s in the engine, one due every 0.1 s: the ceiling binds.
    clock = FakeClock(-START)
    engine = FakeEngine(clock, step_s=0.5, chunk=2)
    rep, records = make(engine, [spec(i, i * 0.1) for i in range(6)], clock, limit=1)
    await rep.run()
    by = {r.index: r for r in records}
    for r in records:
        assert r.ok and r.ttft_s == pytest.approx(0.5) and r.e2e_s == pytest.approx(1.5)
        # Due at index * 0.1 s; first token 0.5 s after the slot it waited for.
        assert r.ttft_offered_s == pytest.approx(r.queue_s + r.lateness_s + r.ttft_s)
        assert r.e2e_offered_s == pytest.approx(r.queue_s + r.lateness_s + r.e2e_s)
    # The last waited for five requests before it (7.5 s) less its 0.5 s offset: the user saw 7.5 s.
    assert by[5].ttft_offered_s == pytest.approx(5 * 1.5 - 0.5 + 0.5)
    assert by[0].ttft_offered_s == pytest.approx(by[0].ttft_s)  # the first found a free slot
    sample = by[5].to_sample(0)
    assert sample.fields["ttft_offered_s"] == pytest.approx(7.5)
    assert sample.fields["e2e_offered_s"] == pytest.approx(8.5)


class EchoIdsEngine(TimedEngine):
    """Reports generated token ids (97, 98, ...) as a real engine does."""

    async def generate(self, request: GenerationRequest) -> AsyncIterator[int]:
        made = 0
        async for n in super().generate(request):
            if request.output_ids is not None:
                request.output_ids.extend(97 + (made + k) % 3 for k in range(n))
            made += n
            yield n


async def test_a_later_turn_replays_the_previous_prompt_and_the_engines_answer() -> None:
    clock = FakeClock(-START)
    engine = EchoIdsEngine(clock, step_s=0.5, chunk=2)
    rep, _ = make(engine, _session_specs(), clock)
    await rep.run()
    by_id = {r.request_id: r for r in engine.requests}
    turn0, turn1, turn2 = by_id["t-0-0"], by_id["t-0-1"], by_id["t-0-3"]
    answer = [97, 98, 99, 97, 98, 99]
    assert list(turn1.prompt_ids[:26]) == list(turn0.prompt_ids) + answer
    assert len(turn1.prompt_ids) == 30  # the trace's length is kept
    assert list(turn2.prompt_ids[:36]) == list(turn1.prompt_ids) + answer
    # The request without a session asks for no ids; history is dropped once superseded.
    assert by_id["t-0-2"].output_ids is None
    assert rep._history_tokens == 40 + 6  # only the last turn's prompt and answer are kept


async def test_system_clock_never_wakes_early_and_survives_cancelled_sleepers() -> None:
    clock = SystemClock()
    start = clock.monotonic()
    # Sleepers cancelled inside the alarm thread's window must not disturb the others.
    doomed = [asyncio.create_task(clock.sleep_until(start + 0.003 + i * 1e-4)) for i in range(5)]
    await asyncio.sleep(0.0015)
    for task in doomed:
        task.cancel()
    deadlines = [start + 0.004 + i * 0.0007 for i in range(20)]
    woke: list[float] = []

    async def sleeper(d: float) -> None:
        await clock.sleep_until(d)
        woke.append(clock.monotonic() - d)

    await asyncio.gather(*(sleeper(d) for d in reversed(deadlines)))
    assert len(woke) == 20 and min(woke) >= 0.0
    # Each doomed sleeper was cancelled, or (on a busy machine, where the loop came back after its
    # deadline) had already woken: never an error.
    assert all(t.cancelled() or t.exception() is None for t in doomed)
    await clock.sleep_until(clock.monotonic() - 1.0)  # a past deadline returns at once


async def test_a_request_without_a_possible_prompt_fails_alone() -> None:
    clock = FakeClock(-START)
    engine = FakeEngine(clock)
    # hash_ids that do not cover the prompt: PromptSynth refuses it.
    bad = RequestSpec(1, 0.2, 40, 6, 16, hash_ids=(1,))
    rep, records = make(engine, [spec(0, 0.0), bad, spec(2, 0.4)], clock)
    stats = await rep.run()
    assert stats.completed == 2 and stats.failed == 1 and stats.scheduled == 3
    by = {r.index: r for r in records}
    assert by[1].error.startswith("prompt: request 1:")


async def test_an_implausible_token_count_fails_the_request_not_the_accounting() -> None:
    clock = FakeClock(-START)
    engine = FakeEngine(clock, huge_on={1})
    rep, records = make(engine, [spec(i, i * 0.1) for i in range(3)], clock)
    stats = await rep.run()
    by_index = {r.index: r for r in records}
    assert stats.completed == 2 and stats.failed == 1
    bad = by_index[1]
    assert bad.error.startswith("implausible output: 1000000000000000 tokens reported for max_tokens")
    # Only what max_tokens allows is counted: the run's tokens stay physical.
    assert bad.output_tokens == bad.output_tokens_expected
    assert stats.output_tokens == sum(r.output_tokens for r in records) < 10**6


async def test_a_replay_behind_its_schedule_still_ends_at_its_duration() -> None:
    """A host that cannot keep the pace (here each prompt takes 1 s of the clock to build) falls behind
    the trace; the run still ends at its duration, and what fell due after it is not sent late."""
    clock = FakeClock(-START)

    class SlowPrompts(PromptSynth):
        def prompt_ids(self, spec: RequestSpec, salt: int = 0, limit: int | None = None) -> list[int]:
            clock.now += 1.0
            return super().prompt_ids(spec, salt, limit)

    engine = FakeEngine(clock)
    rep, records = make(engine, [spec(i, i * 0.1) for i in range(20)], clock, duration=5.0)
    rep._prompts = SlowPrompts(100, 0, (0,))
    stats = await rep.run()
    assert 4 <= stats.scheduled <= 6 < 20, stats
    assert len(records) == stats.scheduled
    assert clock.monotonic() < 5.0 + 5.0 + 1.0  # the duration, the drain bound and one slow prompt


class AheadEngine(FakeEngine):
    """An engine with a sender of its own (`sends_at`): it is handed each request early, waits for its
    `send_at` itself, sends `late_s[index]` after it, and stamps the stream (first token 10 ms after the
    send, then one delta per 5 ms) while it yields the tokens in one lump at the end, as a sender's
    report would."""

    def __init__(
        self,
        clock: FakeClock,
        late_s: dict[int, float],
        stream_s: float = 0.0,
        write_s: dict[int, float] | None = None,
    ) -> None:
        super().__init__(clock)
        self.late_s = late_s
        self.stream_s = stream_s
        self.write_s = write_s  # per index: send to headers written (None: `written` not stamped)
        self.handed: dict[int, float] = {}
        self.send_at: dict[int, float] = {}

    @property
    def info(self) -> EngineInfo:
        return EngineInfo("fake", "0", "m", "cfg", vocab_size=100, max_model_len=64, sends_at=True)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[int]:
        index = int(request.request_id.rsplit("-", 1)[1])
        self.handed[index] = self.clock.monotonic()
        assert request.send_at is not None and request.stamps is not None
        self.send_at[index] = request.send_at
        sent = max(request.send_at, self.clock.monotonic()) + self.late_s.get(index, 0.0)
        await self.clock.sleep_until(sent + self.stream_s)
        deltas = request.max_tokens // 2
        stamps = request.stamps
        stamps.sent, stamps.first = sent, sent + 0.010
        stamps.last = stamps.first + 0.005 * (deltas - 1)
        stamps.gaps, stamps.deltas = 0.005 * (deltas - 1), deltas - 1
        if self.write_s is not None:
            stamps.written = sent + self.write_s.get(index, 0.0)
        yield request.max_tokens


async def test_an_engine_with_its_own_sender_gets_requests_ahead_and_its_stamps_are_the_record() -> None:
    clock = FakeClock(-START)
    engine = AheadEngine(clock, late_s={1: 0.003})
    rep, records = make(engine, [spec(i, 1.0 + i) for i in range(3)], clock, duration=10.0)
    stats = await rep.run()
    assert stats.completed == 3
    for i in range(3):
        due = 1.0 + i
        assert engine.send_at[i] == pytest.approx(due)  # the exact due time, for the sender to keep
        assert due - 0.030 <= engine.handed[i] < due  # handed over ahead of it
    by = {r.index: r for r in records}
    # Lateness is where the sender sent it, not when the pacer handed it on.
    assert by[1].lateness_s == pytest.approx(0.003) and by[0].lateness_s == 0.0
    assert stats.lateness_max_s == pytest.approx(0.003)
    # Latencies come from the sender's stamps, not from when the lump of tokens reached the replay.
    ok = by[0]
    assert ok.ttft_s == pytest.approx(0.010)
    assert ok.e2e_s == pytest.approx(0.010 + 0.005 * 2)
    assert ok.tpot_s == pytest.approx(0.010 / 5)
    assert ok.itl_mean_s == pytest.approx(0.005)
    assert ok.output_tokens == 6


async def test_lateness_counts_until_the_request_was_written() -> None:
    """A connection opened for a request delays its bytes: the server sees it that late, so its
    lateness counts to the written stamp while its TTFT still counts from the send."""
    clock = FakeClock(-START)
    engine = AheadEngine(clock, late_s={2: 0.001}, write_s={1: 0.004, 2: 0.0005})
    rep, records = make(engine, [spec(i, 1.0 + i) for i in range(3)], clock, duration=10.0)
    stats = await rep.run()
    by = {r.index: r for r in records}
    assert by[0].lateness_s == 0.0
    assert by[1].lateness_s == pytest.approx(0.004) and by[2].lateness_s == pytest.approx(0.0015)
    assert stats.lateness_max_s == pytest.approx(0.004)
    assert by[1].ttft_s == pytest.approx(0.010)


async def test_a_request_admitted_after_its_due_time_is_sent_at_once() -> None:
    clock = FakeClock(-START)
    engine = AheadEngine(clock, late_s={}, stream_s=2.0)  # each request holds the only slot for 2 s
    rep, records = make(engine, [spec(0, 1.0), spec(1, 1.5)], clock, limit=1, duration=10.0)
    await rep.run()
    by = {r.index: r for r in records}
    # Admitted when request 0 finished (1.0 + 2.0 + its stamps' lump), not at its own due time.
    assert engine.send_at[1] == pytest.approx(engine.handed[1]) and engine.send_at[1] > 2.9
    assert by[1].queue_s == pytest.approx(engine.send_at[1] - 1.5)  # from its due time
    assert by[0].queue_s == 0.0  # admitted while handed over ahead of its time: no queue
    assert by[1].lateness_s == 0.0  # queued, not late: the queue has its own figure


async def test_a_request_handed_to_the_sender_late_counts_its_lateness_from_its_due_time() -> None:
    """soakd's own process held up (here building request 1's prompt takes 50 ms of the clock, twice the
    sender's lead): the sender gets it 25 ms after it was due and sends it at once. The server saw it 25
    ms late, so its lateness is 25 ms (not 0 from the late hand-off), and TTFT as offered counts it once."""
    clock = FakeClock(-START)

    class SlowPrompts(PromptSynth):
        def prompt_ids(self, spec: RequestSpec, salt: int = 0, limit: int | None = None) -> list[int]:
            if spec.index == 1:
                clock.now += 0.050
            return super().prompt_ids(spec, salt, limit)

    engine = AheadEngine(clock, late_s={})
    rep, records = make(engine, [spec(i, 1.0 + i) for i in range(3)], clock, duration=10.0)
    rep._prompts = SlowPrompts(100, 0, (0,))
    stats = await rep.run()
    by = {r.index: r for r in records}
    assert engine.send_at[1] == pytest.approx(2.025)  # handed on late, so sent at once
    assert by[1].queue_s == 0.0 and by[1].lateness_s == pytest.approx(0.025)
    assert by[0].lateness_s == 0.0 and by[2].lateness_s == 0.0
    assert stats.lateness_max_s == pytest.approx(0.025)
    for r in by.values():
        assert r.ttft_offered_s == pytest.approx(r.queue_s + r.lateness_s + r.ttft_s)


class HeldEngine(AheadEngine):
    """As AheadEngine, but the engine held request 1 for 2 s before its sender got it (a restart), and
    request 2 fails after it was sent 4 ms late."""

    async def generate(self, request: GenerationRequest) -> AsyncIterator[int]:
        index = int(request.request_id.rsplit("-", 1)[1])
        assert request.send_at is not None and request.stamps is not None
        stamps = request.stamps
        if index == 1:
            await self.clock.sleep_until(request.send_at + 2.0)
            stamps.handed = self.clock.monotonic()
            stamps.sent, stamps.first = stamps.handed + 0.001, stamps.handed + 0.011
            stamps.last = stamps.first
            yield request.max_tokens
            return
        if index == 2:
            await self.clock.sleep_until(request.send_at + 0.004)
            stamps.handed, stamps.sent = request.send_at - 0.02, self.clock.monotonic()
            raise RuntimeError("cut")
        async for n in super().generate(request):
            yield n


async def test_time_the_engine_held_a_request_is_ttft_not_lateness_and_a_failed_send_keeps_lateness() -> None:
    clock = FakeClock(-START)
    engine = HeldEngine(clock, late_s={})
    rep, records = make(engine, [spec(i, 1.0 + i) for i in range(3)], clock, duration=10.0)
    await rep.run()
    by = {r.index: r for r in records}
    held = by[1]
    assert held.lateness_s == pytest.approx(0.001)  # sent 1 ms after its sender got it
    # From its due time (plus its own 1 ms lateness): the downtime is in what a user waited.
    assert held.ttft_s == pytest.approx(2.0 + 0.010)
    failed = by[2]
    assert failed.error.startswith("engine: RuntimeError") and failed.lateness_s == pytest.approx(0.004)


class NoSenderEngine(FakeEngine):
    async def generate(self, request: GenerationRequest) -> AsyncIterator[int]:
        raise HarnessError("the sender process exited 6 times within 600 s")
        yield 0  # an async generator


async def test_a_sender_that_cannot_be_kept_running_ends_the_replay_without_blaming_the_engine() -> None:
    clock = FakeClock(-START)
    rep, records = make(NoSenderEngine(clock), [spec(i, 1.0 + i) for i in range(3)], clock, duration=10.0)
    stats = await rep.run()
    assert rep.fatal.startswith("harness: the sender process exited")
    assert records[0].error.startswith("harness:") and stats.scheduled == len(records) == 1
