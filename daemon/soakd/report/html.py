"""The sign-off report of a run: one self-contained HTML file (inline SVG plots, inline CSS, nothing
fetched when it is viewed) and its JSON twin, built from the run's files and its time series.

The JSON twin is the report's content (environment, verdict, digest, the bucketed series); the HTML is
drawn from it alone. The data digest is sha256 over the spool segments in order, then meta.json, then
verdict.json, byte for byte: `cat spool/seg-*.lp meta.json verdict.json | sha256sum` in the run
directory gives the same figure, so a signer can check later that the data was not changed.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import math
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from soakd import __version__
from soakd.files import json_text, write_private
from soakd.judge.verdict import stop_note
from soakd.report.gpus import gpu_rows
from soakd.report.headline import headline, human
from soakd.report.series import ACTION_KINDS, at_path
from soakd.rundir import DIGEST_FILES, SPOOL_DIR
from soakd.sinks.spool import list_segments, open_segment
from soakd.units import format_duration

SCHEMA = 1
_EVENT_ROWS = 400  # the HTML lists at most this many events; the JSON has them all


def data_digest(run_dir: Path) -> dict[str, Any]:
    """sha256 over the spool segments (in order), meta.json and verdict.json, and the files it covers."""
    h = hashlib.sha256()
    names: list[str] = []
    paths = [*list_segments(run_dir / SPOOL_DIR), *(run_dir / n for n in DIGEST_FILES)]
    total = 0
    for path in paths:
        try:
            fh = open_segment(path)  # regular files only, never through a symlink
        except FileNotFoundError:
            continue
        with fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
                total += len(chunk)
        names.append(path.relative_to(run_dir).as_posix())
    return {
        "sha256": h.hexdigest(),
        "files": names,
        "bytes": total,
        "recompute": "cd RUN_DIR && cat spool/seg-*.lp meta.json verdict.json | sha256sum",
    }


def _text(value: Any) -> str:
    if value is None or value == "":
        return "not recorded"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list | dict):
        return json.dumps(value, sort_keys=True)
    return str(value)


def _engine_history(engines: Any) -> list[tuple[str, Any]]:
    """Each engine configuration of a run that rebuilt its engine: its start and CUDA-graph sizes."""
    eng: list[tuple[str, Any]] = []
    if isinstance(engines, list) and len(engines) > 1:
        ids = [str(e.get("config_id")) for e in engines if isinstance(e, Mapping)]
        eng.append(("engine configs over the run", " -> ".join(ids)))
        # Each configuration's start and CUDA-graph sizes: a re-capture or a rebuild changes them.
        for n, e in enumerate(x for x in engines if isinstance(x, Mapping)):
            start = e.get("start_s")
            text = (
                f"started in {float(start):.1f} s" if isinstance(start, int | float) else "start not recorded"
            )
            if e.get("cudagraphs"):
                text += f"; capture sizes {', '.join(str(x) for x in e.get('capture_sizes') or [])}"
            eng.append((f"engine {n + 1} ({e.get('config_id')})", text))
    return eng


def environment(
    meta: Mapping[str, Any], data: Mapping[str, Any], summary: Mapping[str, Any] | None = None
) -> list[dict[str, Any]]:
    """What the run ran on, from meta.json (and the GPU series where meta.json does not say)."""
    cfg = meta.get("config") if isinstance(meta.get("config"), Mapping) else {}
    engine = meta.get("engine") if isinstance(meta.get("engine"), Mapping) else {}
    trace = meta.get("trace") if isinstance(meta.get("trace"), Mapping) else {}
    assert isinstance(cfg, Mapping) and isinstance(engine, Mapping) and isinstance(trace, Mapping)

    run = [
        ("run id", meta.get("run_id")),
        ("host", meta.get("host")),
        ("started (UTC)", meta.get("started_utc")),
        ("planned duration (s)", at_path(cfg, "run.duration")),
        ("resumed after crashes", meta.get("resumes")),
        ("config file", meta.get("config_source")),
        ("soakd version", meta.get("soakd_version")),
        ("Python", meta.get("python")),
    ]
    gpu = gpu_rows(meta, cfg, data, summary or {})

    spec = at_path(cfg, "engine.speculative") or {}
    details = engine.get("details") if isinstance(engine.get("details"), Mapping) else {}
    assert isinstance(details, Mapping)
    eng = [
        ("engine", engine.get("kind") or at_path(cfg, "engine.kind")),
        ("vLLM version", engine.get("version")),
        ("model", engine.get("model") or at_path(cfg, "engine.model")),
        ("engine config id", engine.get("config_id")),
        ("platform", details.get("platform")),
        ("CUDA-graph mode", details.get("cudagraph_mode")),
        ("max_num_seqs", details.get("max_num_seqs") or at_path(cfg, "engine.max_num_seqs")),
        ("max_model_len", engine.get("max_model_len") or at_path(cfg, "engine.max_model_len")),
        ("dtype", at_path(cfg, "engine.dtype")),
        ("gpu_memory_utilization", at_path(cfg, "engine.gpu_memory_utilization")),
        ("enforce_eager", at_path(cfg, "engine.enforce_eager")),
        ("prefix caching", at_path(cfg, "engine.enable_prefix_caching")),
        (
            "speculative decoding",
            f"{spec.get('method')}, {spec.get('num_speculative_tokens')} tokens"
            if isinstance(spec, Mapping) and spec.get("enabled")
            else "off",
        ),
        ("extra engine args", at_path(cfg, "engine.extra_args")),
        ("engine start (s)", engine.get("start_s")),
    ]
    eng += _engine_history(meta.get("engines"))
    tr = [
        ("path", trace.get("path") or at_path(cfg, "trace.path")),
        ("sha256", trace.get("sha256")),
        ("format", trace.get("format")),
        ("requests", trace.get("requests")),
        ("span (s)", trace.get("span_s")),
        ("sessions", trace.get("sessions")),
        ("replay speed", at_path(cfg, "replay.speed")),
    ]
    return [
        {"group": name, "items": [[k, _text(v)] for k, v in items]}
        for name, items in (("Run", run), ("GPU", gpu), ("Engine", eng), ("Trace", tr))
    ]


def build_doc(
    run_dir: Path,
    meta: Mapping[str, Any],
    verdict: Mapping[str, Any],
    data: Mapping[str, Any],
    *,
    source: str,
    now: datetime | None = None,
    summary: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The report (the JSON twin). Everything but `generated` is the same whichever source the series
    came from."""
    return {
        "schema": SCHEMA,
        "run_id": verdict.get("run_id") or meta.get("run_id"),
        "verdict": dict(verdict),
        "headline": headline(verdict, summary or {}),
        "environment": environment(meta, data, summary),
        "digest": data_digest(run_dir),
        "data": dict(data),
        "generated": {
            "utc": (now or datetime.now(UTC)).isoformat(timespec="seconds"),
            "source": source,
            "soakd_version": __version__,
        },
    }


# -- plots ------------------------------------------------------------------------------------------

_GPU_SHADE = "#d62728"
_HOST_SHADE = "#ff7f0e"


def _time_axis(span_s: float) -> tuple[float, str]:
    if span_s <= 900:
        return 1.0, "s"
    if span_s <= 3 * 3600:
        return 60.0, "min"
    return 3600.0, "h"


def _with_gaps(
    t: Sequence[float | None], y: Sequence[float | None], width: float
) -> tuple[list[float], list[float]]:
    """NaN where points are much further apart than usual (a bucket, or the series' own interval if
    longer), so a gap (an engine rebuild) shows as a gap and a 5 s series is still a line."""
    known = [x for x in t if x is not None]
    steps = sorted(b - a for a, b in itertools.pairwise(known))
    usual = steps[len(steps) // 2] if steps else width
    limit = max(1.5 * width, 2.5 * usual)
    xs: list[float] = []
    ys: list[float] = []
    prev: float | None = None
    for x, v in zip(t, y, strict=True):
        if x is None:
            continue
        if prev is not None and x - prev > limit:
            xs.append((prev + x) / 2)
            ys.append(math.nan)
        xs.append(x)
        ys.append(math.nan if v is None else v)
        prev = x
    return xs, ys


class _Plotter:
    """Draws the report's panels as inline SVG with matplotlib (no pyplot: no global figure state)."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        import matplotlib

        matplotlib.use("Agg")
        # Stable ids and no date: the same data draws the same SVG; text stays text (smaller, selectable).
        matplotlib.rcParams.update({"svg.hashsalt": "soakd-report", "svg.fonttype": "none", "font.size": 9})
        self.data = data
        self.span_s = float(data.get("span_s") or 0.0) or 1.0
        self.scale, self.unit = _time_axis(self.span_s)

    def _figure(self, rows: int = 1, height: float = 2.4) -> Any:
        from matplotlib.figure import Figure

        fig = Figure(figsize=(10, height * rows))
        # Fixed margins, the same on every plot (time axes line up down the page); constrained layout
        # would draw each figure twice.
        inch = height * rows
        # Room under the last axis for two-line ticks (UTC over run time) and the axis label.
        fig.subplots_adjust(left=0.13, right=0.94, top=1 - 0.15 / inch, bottom=0.8 / inch, hspace=0.12)
        axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
        for ax in axes:
            ax.set_xlim(0, self.span_s / self.scale)
            ax.grid(True, alpha=0.3, linewidth=0.5)
        self._wall_clock(axes[-1])
        return fig, list(axes)

    def _wall_clock(self, ax: Any) -> None:
        """Ticks in UTC wall-clock time (what a person matches against other logs), each with the run's
        own time under it."""
        from matplotlib.ticker import FuncFormatter

        t0 = self.data.get("t0_ns")
        if not isinstance(t0, int):
            ax.set_xlabel(f"time since the run's first point ({self.unit})")
            return
        seconds = self.span_s <= 900

        def label(x: float, _pos: object) -> str:
            at = datetime.fromtimestamp(t0 / 1e9 + x * self.scale, UTC)
            clock = at.strftime("%H:%M:%S" if seconds else "%H:%M")
            return f"{clock}\n+{x:g} {self.unit}"

        ax.xaxis.set_major_formatter(FuncFormatter(label))
        start = datetime.fromtimestamp(t0 / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%S")
        ax.set_xlabel(f"UTC (run time below; first point {start} UTC)")

    def _shade(self, ax: Any) -> None:
        # The engine was down (a rebuild or a restart): no traffic then, on every plot.
        for e in self.data.get("events", []):
            down = (e.get("fields") or {}).get("downtime_s")
            if isinstance(down, int | float) and down > 0:
                start = (e["t_s"] - float(down)) / self.scale
                ax.axvspan(start, e["t_s"] / self.scale, color="0.5", alpha=0.18, linewidth=0, hatch="//")
        for ep in self.data.get("episodes", []):
            color = _HOST_SHADE if ep["scope"] == "host CPUs" else _GPU_SHADE
            start, end = ep["start_s"] / self.scale, ep["end_s"] / self.scale
            rec = ep.get("recovering_s")
            mid = rec / self.scale if rec is not None else end
            ax.axvspan(start, mid, color=color, alpha=0.15, linewidth=0)
            if mid < end:
                ax.axvspan(mid, end, color=color, alpha=0.06, linewidth=0)

    def _svg(self, fig: Any) -> str:
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None})
        text = buf.getvalue()
        start = text.find("<svg")
        return text[start:] if start >= 0 else text

    def panel(self, name: str, panel: Mapping[str, Any]) -> str:
        fig, (ax,) = self._figure()
        width = float(self.data.get("latency_bucket_s" if name in ("ttft", "tpot") else "bucket_s") or 1.0)
        for i, s in enumerate(panel["series"]):
            color = f"C{i % 10}"
            t = [None if x is None else x / self.scale for x in s["t"]]
            xs, mid = _with_gaps(t, s.get("mid") or [None] * len(t), width / self.scale)
            # Markers where there are few points: a lone point between gaps is still seen.
            marker = "." if len(xs) < 80 else None
            ax.plot(xs, mid, color=color, linewidth=1.2, marker=marker, markersize=3, label=s["name"])
            if "lo" in s and "hi" in s and s["lo"] != s["hi"]:
                _, lo = _with_gaps(t, s["lo"], width / self.scale)
                _, hi = _with_gaps(t, s["hi"], width / self.scale)
                ax.fill_between(xs, lo, hi, color=color, alpha=0.2, linewidth=0)
        for ref in panel.get("refs", []):
            ax.axhline(ref["value"], color="0.3", linestyle="--", linewidth=0.9, label=ref["name"])
        counts = panel.get("counts") or []
        if counts:
            twin = ax.twinx()
            for s in counts:
                t = [x / self.scale for x in s["t"] if x is not None]
                twin.bar(t, s["mid"], width=width / self.scale, color="#d62728", alpha=0.5, label=s["name"])
            twin.set_ylabel("requests per bucket")
        if panel.get("log"):
            from matplotlib.ticker import FuncFormatter, NullFormatter

            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _p: human(v)))
            ax.yaxis.set_minor_formatter(NullFormatter())
        elif name in _FROM_ZERO:
            # From zero (shares up to one): a 0.1 % wobble is drawn as one, not as a cliff.
            high = ax.get_ylim()[1]
            ax.set_ylim(0.0, max(high, 1.0) if name in _SHARES else high * 1.05)
        ax.set_ylabel(panel.get("unit", ""))
        self._shade(ax)
        if panel["series"] or panel.get("refs"):
            ax.legend(loc="upper left", fontsize=7, ncols=4, framealpha=0.7)
        return self._svg(fig)

    def actions(self, panel: Mapping[str, Any], events: Sequence[Mapping[str, Any]]) -> str:
        ceiling = panel["series"]
        kinds = sorted({e["kind"] for e in events})
        rows = 2 if ceiling else 1
        fig, axes = self._figure(rows, height=max(2.2, 0.2 * len(kinds) + 0.9))
        ax = axes[0]
        for i, kind in enumerate(kinds):
            mine = [e for e in events if e["kind"] == kind]
            xs = [e["t_s"] / self.scale for e in mine]
            ax.scatter(xs, [i] * len(xs), marker="|", s=120, color=f"C{i % 10}", linewidths=2)
            # A rebuild or restart is written when it is done: draw the time the engine was down.
            for e in mine:
                down = (e.get("fields") or {}).get("downtime_s")
                if isinstance(down, int | float) and down > 0:
                    start = (e["t_s"] - float(down)) / self.scale
                    ax.hlines(i, start, e["t_s"] / self.scale, color=f"C{i % 10}", linewidth=5, alpha=0.45)
        ax.set_yticks(range(len(kinds)), kinds, fontsize=7)
        ax.set_ylim(-0.7, max(len(kinds), 1) - 0.3)
        self._shade(ax)
        if ceiling:
            s = ceiling[0]
            t = [None if x is None else x / self.scale for x in s["t"]]
            xs, mid = _with_gaps(t, s["mid"], float(self.data.get("bucket_s") or 1.0) / self.scale)
            axes[1].step(xs, mid, where="mid", color="C0", linewidth=1.2)
            axes[1].set_ylabel("concurrency\nceiling")
            self._shade(axes[1])
        return self._svg(fig)


# Panels drawn from zero (levels whose change matters relative to their size), and shares drawn to 1.
_FROM_ZERO = frozenset(
    {"sm_clock", "power", "throughput", "spec_acceptance", "cudagraph", "bandwidth", "fragmentation"}
)
_SHARES = frozenset({"spec_acceptance", "cudagraph"})

PANEL_ORDER = (
    "sm_clock",
    "power",
    "temperature",
    "throughput",
    "ttft",
    "tpot",
    "spec_acceptance",
    "spec_drift",
    "cudagraph",
    "bandwidth",
    "fragmentation",
)


def _fmt_time(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


_WINDOW = re.compile(r"\b(window|last|first)=(\d+(?:\.\d+)?)s\b")


def _fmt_metric(name: Any) -> str:
    """A criterion's canonical name with its durations as people write them (window=5m, not 300s); the
    name in verdict.json stays canonical."""
    return _WINDOW.sub(lambda m: f"{m.group(1)}={format_duration(float(m.group(2)))}", str(name))


def render_html(doc: Mapping[str, Any]) -> str:
    """The HTML page of a report document (build_doc's result)."""
    import jinja2

    data = doc["data"]
    plotter = _Plotter(data)
    # A panel without data is one entry of a single line, not a box of its own: on a CPU run most of
    # the page would otherwise be "no data".
    figures: list[dict[str, Any]] = []
    missing: dict[str, list[dict[str, str]]] = {}
    for name in PANEL_ORDER:
        panel = data["panels"][name]
        if panel["why"]:
            # Grouped by why: a collector that was off is said once for all its panels.
            missing.setdefault(panel["why"], []).append({"id": name, "title": panel["title"]})
        else:
            figures.append({"id": name, "title": panel["title"], "svg": plotter.panel(name, panel)})
    events = data.get("events", [])
    actions = data["panels"]["actions"]
    has_actions = any(e["kind"] in ACTION_KINDS for e in events)
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("soakd", "data"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["t"] = _fmt_time
    env.filters["num"] = human
    env.filters["metric"] = _fmt_metric
    template = env.get_template("report.html.j2")
    verdict = doc["verdict"]
    return template.render(
        doc=doc,
        verdict=verdict,
        stopped=stop_note(verdict),
        criteria=verdict.get("criteria", []),
        has_expr=any("expr" in c for c in verdict.get("criteria", [])),
        requests=verdict.get("requests") or {},
        figures=figures,
        missing=missing,
        actions_svg=plotter.actions(actions, events) if events else None,
        actions_note=None
        if has_actions
        else "no control actions, recaptures, rebuilds or restarts in this run",
        events=events[:_EVENT_ROWS],
        events_left=max(0, len(events) - _EVENT_ROWS),
        episodes=data.get("episodes", []),
        span=data.get("span_s") or 0.0,
    )


def write_report(doc: Mapping[str, Any], html_path: Path | None, json_path: Path) -> None:
    """Render first, then write each file atomically (0600): nothing is half-written."""
    page = render_html(doc).encode("utf-8") if html_path is not None else None
    write_private(json_path, (json_text(doc, indent=1, sort_keys=True) + "\n").encode("utf-8"), fsync=True)
    if html_path is not None and page is not None:
        write_private(html_path, page, fsync=True)
