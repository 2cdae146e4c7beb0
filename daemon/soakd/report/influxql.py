"""Read a run's points back from InfluxDB with InfluxQL over HTTP `/query` (1.x; 2.x through a DBRP
mapping; 3.x's v1 query API), as Samples, so the report is built from them as from the spool.

The run is read in time windows (InfluxDB 3 Core refuses long ranges), one measurement at a time and
only the fields the report draws. A window whose answer the server cut short (`partial`, a row limit)
is read again in halves.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from soakd.config import Config, InfluxConfig
from soakd.errors import SinkError, UsageError
from soakd.judge.metrics import RunMetrics
from soakd.metric import FieldValue, Sample
from soakd.report.runs import READ_FIELDS, fold_run, fold_spool
from soakd.report.series import SeriesBuilder
from soakd.rundir import META_FILE
from soakd.sinks.influx import read_secret

WINDOW_NS = 6 * 3600 * 10**9
_MIN_WINDOW_NS = 10**9
_MAX_REASON = 300


def _ident(name: str) -> str:
    return '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _string(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def query_text(measurement: str, run_id: str, start_ns: int, end_ns: int) -> str:
    """The InfluxQL statement for one measurement of one run over [start_ns, end_ns)."""
    wanted = READ_FIELDS.get(measurement)
    what = "*" if wanted is None else ",".join(_ident(f) for f in wanted)
    # GROUP BY *: tags come back per series, not as columns mixed with the fields. Names are quoted as
    # identifiers and the run id as a string literal (escaped), the times are integers.
    return (
        f'SELECT {what} FROM {_ident(measurement)} WHERE "run_id" = {_string(run_id)} '  # noqa: S608
        f"AND time >= {start_ns} AND time < {end_ns} GROUP BY *"
    )


class InfluxReader:
    """`/query` against the server and database of a `[sinks.influx]` section; secrets as the writers
    read them (systemd credentials or the environment variables it names)."""

    def __init__(
        self,
        cfg: InfluxConfig,
        env: Mapping[str, str],
        *,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = cfg.url.rstrip("/")
        parts = urlsplit(self.url)
        # What messages name: never a user:password@ written into the URL.
        self.shown_url = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
        if cfg.api == "v2" and cfg.bucket:
            # The v2 bucket "db/rp" (1.8) or a 2.x bucket name that its DBRP mapping (or 3.x) answers to.
            self.database, _, self.retention_policy = cfg.bucket.partition("/")
        else:
            self.database, self.retention_policy = cfg.database, cfg.retention_policy
        headers: dict[str, str] = {}
        auth: httpx.BasicAuth | None = None
        token = read_secret(cfg.token_env, env, key="sinks.influx.token_env") if cfg.api == "v2" else ""
        if token:
            headers["Authorization"] = f"Token {token}"
        elif cfg.username:
            auth = httpx.BasicAuth(
                cfg.username, read_secret(cfg.password_env, env, key="sinks.influx.password_env")
            )
        self._client = httpx.Client(timeout=cfg.timeout, headers=headers, auth=auth, transport=transport)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> InfluxReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _query(self, statement: str) -> dict[str, Any]:
        params = {"db": self.database, "epoch": "ns", "q": statement}
        if self.retention_policy:
            params["rp"] = self.retention_policy
        try:
            response = self._client.post(self.url + "/query", data=params)
        except httpx.HTTPError as err:
            raise SinkError(
                f"InfluxDB query at {self.shown_url}: {type(err).__name__}: {err}"[:_MAX_REASON]
            ) from err
        if not response.is_success:
            raise SinkError(
                f"InfluxDB query at {self.shown_url}: HTTP {response.status_code}: {response.text}"[
                    :_MAX_REASON
                ]
            )
        try:
            doc = response.json()
            result = doc["results"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            raise SinkError(f"InfluxDB query at {self.shown_url}: not an InfluxQL answer") from None
        if not isinstance(result, dict):
            raise SinkError(f"InfluxDB query at {self.shown_url}: not an InfluxQL answer")
        if isinstance(result.get("error"), str):
            raise SinkError(f"InfluxDB query: {result['error']}"[:_MAX_REASON])
        return result

    def samples(self, measurement: str, run_id: str, start_ns: int, end_ns: int) -> Iterator[Sample]:
        """The run's points of one measurement in [start_ns, end_ns), window by window."""
        at = start_ns
        while at < end_ns:
            stop = min(at + WINDOW_NS, end_ns)
            yield from self._window(measurement, run_id, at, stop)
            at = stop

    def _window(self, measurement: str, run_id: str, start_ns: int, end_ns: int) -> Iterator[Sample]:
        result = self._query(query_text(measurement, run_id, start_ns, end_ns))
        series = result.get("series") or []
        partial = bool(result.get("partial")) or any(isinstance(s, dict) and s.get("partial") for s in series)
        if partial:
            if end_ns - start_ns <= _MIN_WINDOW_NS:
                raise SinkError(f"InfluxDB cut short its answer for {measurement} even over one second")
            mid = start_ns + (end_ns - start_ns) // 2
            yield from self._window(measurement, run_id, start_ns, mid)
            yield from self._window(measurement, run_id, mid, end_ns)
            return
        for s in series:
            yield from _rows(measurement, s)


def _rows(measurement: str, series: Mapping[str, Any]) -> Iterator[Sample]:
    # GROUP BY * names every tag key of the measurement; a series without one has it as "".
    tags = {str(k): str(v) for k, v in (series.get("tags") or {}).items() if v not in ("", None)}
    columns = [str(c) for c in series.get("columns") or []]
    if not columns or columns[0] != "time":
        raise SinkError(f"InfluxDB answered {measurement} without a time column")
    for row in series.get("values") or []:
        fields: dict[str, FieldValue] = {
            name: value
            for name, value in zip(columns[1:], row[1:], strict=True)
            if isinstance(value, int | float | str | bool)
        }
        if fields:
            yield Sample(measurement, fields, int(row[0]), tags)


def run_window(meta: Mapping[str, Any], now_ns: int) -> tuple[int, int]:
    """Where to look for a run's points: from 10 min before it started to when it must have ended
    (twice its planned duration and 12 h more, at least 48 h; never past now)."""
    from datetime import datetime

    started = meta.get("started_utc")
    try:
        start_ns = int(datetime.fromisoformat(str(started)).timestamp() * 1e9) - 600 * 10**9
    except ValueError:
        raise ValueError(f"started_utc is not an ISO time: {started!r}") from None
    planned = meta.get("config", {}).get("run", {}).get("duration", 0.0)
    span_ns = int(max(48 * 3600.0, 2 * float(planned or 0.0) + 12 * 3600.0) * 1e9)
    return start_ns, max(start_ns + 1, min(now_ns, start_ns + span_ns))


def run_samples(reader: InfluxReader, run_id: str, start_ns: int, end_ns: int) -> Iterator[Sample]:
    """Every point of the run that the report reads (the plots' and the verdict's measurements)."""
    for measurement in READ_FIELDS:
        yield from reader.samples(measurement, run_id, start_ns, end_ns)


def read_run(
    run_dir: Path, meta: dict[str, Any], cfg: Config, *, from_influx: bool
) -> tuple[RunMetrics, SeriesBuilder]:
    """A finished run's metrics and the report's series, from its spool or (from_influx) InfluxDB."""
    import os
    import time

    if not from_influx:
        return fold_spool(run_dir)
    try:
        start, end = run_window(meta, time.time_ns())
    except ValueError as err:
        raise UsageError(str(err), file=run_dir / META_FILE) from None
    with InfluxReader(cfg.sinks.influx, os.environ) as reader:
        metrics, series = fold_run(run_samples(reader, str(meta["run_id"]), start, end))
    if series.points == 0:
        raise UsageError(
            f"InfluxDB at {reader.shown_url} (database {reader.database!r}) "
            f"holds no points of run {meta['run_id']}"
        )
    return metrics, series
