"""The ablation matrix: one trace and one config run against variants that each change one thing.

A matrix is a base set of overrides (everything off: the baseline) and a list of variants, each a set of
config overrides on top of it (`--set` keys). Every applicable variant is a full `soakd run`, one after
the other, each in its own process with its own engine, run directory and run id; a variant that needs
hardware the engine does not have (CUDA graphs on the CPU build) is a row that says so and is not run.
The result is the field notes' table, with each row's run linked and its deltas against the baseline,
written as matrix.md and matrix.json to the matrix directory and rewritten after every row.

Over 500 lines because planning, running each variant in its own process and the comparison table share one
variant record.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any, Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from soakd import config
from soakd.errors import ConfigError, UsageError
from soakd.files import write_json_atomic
from soakd.report.compare import (
    DEFAULT_TOLERANCE_PCT,
    compare_metrics,
    fmt_bytes,
    fmt_rel,
    fmt_value,
    trace_warning,
)
from soakd.report.runs import load_metrics, read_json
from soakd.rundir import META_FILE, VERDICT_FILE

log = structlog.get_logger(__name__)

MATRIX_MD = "matrix.md"
MATRIX_JSON = "matrix.json"

# Field notes: a 2048-token chunk suited edge cards (above 8192 risked OOM or a smaller KV cache).
DEFAULT_CHUNK = 2048


class Variant(BaseModel):
    """[[variant]]: one row of the matrix."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    name: str = Field(pattern=r"^[A-Za-z0-9+._-]{1,40}$")
    what: str = ""
    """What changed against the baseline, for the table (default: the overrides themselves)."""
    set: dict[str, Any] = Field(default_factory=dict)
    """Config overrides on top of the matrix's base (dotted keys, as `soakd run --set` takes them)."""
    needs: Literal["", "cuda"] = ""
    """Hardware the variant means something on: "cuda" rows are not run on the CPU build."""


class MatrixSpec(BaseModel):
    """A matrix file: the base overrides every variant starts from, and the variants."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    config: str = ""
    """The run config all variants share (relative to the matrix file); --config overrides it."""
    base: dict[str, Any] = Field(default_factory=dict)
    """Overrides applied to every variant: what "baseline" means (everything under test off)."""
    baseline: str = ""
    """The variant the deltas are against (default: the first)."""
    variant: list[Variant] = Field(min_length=1)

    @model_validator(mode="after")
    def _names(self) -> MatrixSpec:
        names = [v.name for v in self.variant]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"variant name {dup!r} is used twice")
        if self.baseline and self.baseline not in names:
            raise ValueError(f"baseline {self.baseline!r} is not a variant's name")
        return self

    @property
    def baseline_name(self) -> str:
        return self.baseline or self.variant[0].name


_SPEC_ON = {"engine.speculative.enabled": True}
_GRAPHS_ON = {"engine.enforce_eager": False}
_CHUNKED_ON = {
    "engine.extra_args.enable_chunked_prefill": True,
    "engine.extra_args.max_num_batched_tokens": DEFAULT_CHUNK,
}

DEFAULT_MATRIX = MatrixSpec(
    base={
        "engine.speculative.enabled": False,
        "engine.enforce_eager": True,
        "engine.extra_args.enable_chunked_prefill": False,
    },
    variant=[
        Variant(name="baseline", what="speculation off, eager (no CUDA graphs), chunked prefill off"),
        Variant(name="+speculation", what="speculative decoding ([engine.speculative] method)", set=_SPEC_ON),
        Variant(
            name="+cuda-graphs", what="CUDA graphs (enforce_eager = false)", set=_GRAPHS_ON, needs="cuda"
        ),
        Variant(
            name="+chunked-prefill", what=f"chunked prefill, {DEFAULT_CHUNK}-token chunks", set=_CHUNKED_ON
        ),
        Variant(
            name="+spec+graphs",
            what="speculation + CUDA graphs",
            set={**_SPEC_ON, **_GRAPHS_ON},
            needs="cuda",
        ),
        Variant(
            name="+all-three",
            what="speculation + CUDA graphs + chunked prefill",
            set={**_SPEC_ON, **_GRAPHS_ON, **_CHUNKED_ON},
            needs="cuda",
        ),
    ],
)


def flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys from a TOML table: `{"engine.x" = 1}` and `{engine = {x = 1}}` both give engine.x."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            out.update(flatten(value, dotted))
        else:
            out[dotted] = value
    return out


def load_matrix(path: Path) -> MatrixSpec:
    """Read and validate a matrix file; a bad one is a ConfigError naming file, line and key."""
    text, data = config.read_toml(path)
    try:
        return MatrixSpec.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        loc = [str(p) for p in first["loc"]]
        msg = str(first["msg"]).removeprefix("Value error, ")
        reason = "unknown key" if first["type"] == "extra_forbidden" else msg[:1].lower() + msg[1:]
        line = _line_of(text, loc)
        raise ConfigError(reason, file=path, line=line, key=".".join(loc) or None) from None


def _line_of(text: str, loc: Sequence[str]) -> int | None:
    """The line that `loc` points at: a key of the n-th [[variant]] (else that table's header), or a
    top-level key or table."""
    lines = text.splitlines()
    if loc and loc[0] == "variant" and len(loc) > 1 and loc[1].isdigit():
        headers = [i for i, raw in enumerate(lines) if raw.strip().startswith("[[variant]]")]
        n = int(loc[1])
        if n >= len(headers):
            return None
        start = headers[n]
        end = next(
            (i for i, raw in enumerate(lines) if i > start and raw.lstrip().startswith("[")), len(lines)
        )
        if len(loc) > 2:
            for i in range(start + 1, end):
                if re.match(rf"\s*{re.escape(loc[2])}\s*=", lines[i]):
                    return i + 1
        return start + 1
    if loc:
        for i, raw in enumerate(lines, 1):
            if re.match(rf"\s*{re.escape(loc[0])}\s*=", raw) or raw.strip() == f"[{loc[0]}]":
                return i
    return None


@dataclass(frozen=True, slots=True)
class Planned:
    """A variant with its full overrides, validated against the config (before anything runs)."""

    variant: Variant
    overrides: dict[str, Any]
    kind: str
    """engine.kind of the variant's config."""


def plan(
    spec: MatrixSpec,
    config_path: Path | None,
    overrides: dict[str, Any],
    *,
    matrix_file: Path | None = None,
) -> list[Planned]:
    """Each variant's overrides (shared --set, the base, its own), each checked by loading the config."""
    out = []
    base_name = config.load(config_path, overrides, env=os.environ).run.name
    for i, v in enumerate(spec.variant):
        own = flatten(v.set)
        if any(k == "trace" or k.startswith("trace.") for k in own):
            raise ConfigError(
                "a variant may not change the trace (the matrix runs one trace against every variant)",
                file=matrix_file,
                key=f"variant.{i}.set",
            )
        full = {**overrides, **flatten(spec.base), **own}
        for key, value in full.items():
            if not _plain(value):
                # Each override travels to `soakd run` as --set KEY=VALUE (TOML): dates cannot.
                raise ConfigError(f"{key}: not a string, number, boolean or array of them", file=matrix_file)
        full["run.name"] = _run_name(base_name, v.name)
        try:
            cfg = config.load(config_path, full, env=os.environ)
        except ConfigError as err:
            if err.file is not None or matrix_file is None:
                raise
            raise ConfigError(
                f"variant {v.name!r}: {err.reason}",
                file=matrix_file,
                line=_line_of(matrix_file.read_text(encoding="utf-8"), ["variant", str(i), "set"]),
                key=err.key,
            ) from None
        if cfg.engine.kind == "openai":
            raise UsageError(
                "soakd matrix starts an engine per variant: engine.kind must be vllm-local or vllm-server "
                "(an attached server's configuration cannot be varied)"
            )
        out.append(Planned(v, full, cfg.engine.kind))
    return out


def _plain(value: Any) -> bool:
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    return isinstance(value, str | int | float | bool)


def _run_name(base: str, variant: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", variant).strip("-") or "variant"
    return f"{base}-{slug}"[:64]


def set_args(overrides: dict[str, Any]) -> list[str]:
    """`--set KEY=VALUE` arguments for `soakd run`, each value written as TOML (JSON's scalars and
    arrays are TOML's)."""
    out = []
    for key, value in overrides.items():
        out += ["--set", f"{key}={json.dumps(value)}"]
    return out


@dataclass(slots=True)
class Row:
    """One variant's line of the matrix."""

    variant: str
    what: str
    status: Literal["pending", "ran", "failed", "not applicable", "not run"]
    reason: str = ""
    run_id: str = ""
    run_dir: str = ""
    link: str = ""
    """The run directory relative to the matrix directory (markdown link target)."""
    exit_code: int | None = None
    verdict: str = ""
    platform: str = ""
    trace_sha256: str = ""
    metrics: dict[str, float | None] = field(default_factory=dict)
    vs_baseline: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per metric: delta, rel (fraction of the baseline), status (better/worse/same/changed/n/a)."""
    overrides: dict[str, Any] = field(default_factory=dict)


# (argv after `soakd`, log file) -> (exit code, stdout)
Launch = Callable[[list[str], Path], tuple[int, str]]


class _ChildStop:
    """Forwards SIGINT/SIGTERM/SIGHUP to the running `soakd run`, as SIGTERM (it drains and writes its
    verdict)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self._stopped = ""

    def stopped(self) -> str:
        """The signal that stopped the matrix ("" while none has)."""
        return self._stopped

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        def handler(signum: int, _frame: FrameType | None) -> None:
            self._stopped = signal.Signals(signum).name
            if self.proc is not None and self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)

        old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def launch(self, argv: list[str], log_file: Path) -> tuple[int, str]:
        fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as err:
            # Its own session: a Ctrl-C reaches the matrix, which stops the run the way systemd would.
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "soakd", *argv],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                start_new_session=True,
            )
            try:
                out, _ = self.proc.communicate()
            finally:
                if self.proc.poll() is None:
                    self.proc.kill()
                    self.proc.wait()
        return self.proc.returncode, out


def _gpu_present() -> bool:
    """Whether NVML sees a GPU (the platform of a matrix none of whose runs said theirs)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount()) > 0
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - any NVML failure (no library, no driver) means no GPU to use
        return False


@dataclass
class Matrix:
    """Runs a planned matrix into `out_dir` and writes its table after every row."""

    planned: list[Planned]
    baseline: str
    out_dir: Path
    config_path: Path | None
    tolerance_pct: float = DEFAULT_TOLERANCE_PCT
    launch: Launch | None = None
    gpu_present: Callable[[], bool] = _gpu_present
    rows: list[Row] = field(default_factory=list)
    platform: str = ""
    started_utc: str = field(default_factory=lambda: datetime.now(UTC).isoformat())

    def run(self) -> list[Row]:
        self.rows = [
            Row(p.variant.name, p.variant.what or _what(p.variant.set), "pending", overrides=p.overrides)
            for p in self.planned
        ]
        stopper = _ChildStop()
        launch = self.launch or stopper.launch
        # Rows that need a GPU go last: by then a finished run has said which platform the engine is on.
        order = sorted(range(len(self.planned)), key=lambda i: self.planned[i].variant.needs != "")
        with stopper.installed():
            for i in order:
                row, p = self.rows[i], self.planned[i]
                if stopper.stopped():
                    row.status, row.reason = "not run", f"matrix stopped ({stopper.stopped()})"
                elif p.variant.needs == "cuda" and not self._has_cuda():
                    row.status, row.reason = "not applicable", "not applicable (CPU: no CUDA graphs)"
                else:
                    log.info("matrix_variant_start", variant=row.variant, index=i + 1, of=len(self.rows))
                    self._run_one(row, p, launch)
                    if stopper.stopped() and row.status == "ran":
                        # Drained and judged, but over part of the replay: not the variant's numbers.
                        row.status, row.reason = "failed", f"stopped ({stopper.stopped()}) during the run"
                    log.info(
                        "matrix_variant_end", variant=row.variant, status=row.status, verdict=row.verdict
                    )
                self._finish()
        return self.rows

    @property
    def stopped(self) -> bool:
        return any(r.status == "not run" for r in self.rows)

    def _has_cuda(self) -> bool:
        if not self.platform:
            self.platform = "cuda" if self.gpu_present() else "cpu"
        return self.platform != "cpu"

    def _run_one(self, row: Row, p: Planned, launch: Launch) -> None:
        argv = ["run", "--json", "--no-progress"]
        if self.config_path is not None:
            argv += ["--config", str(self.config_path)]
        argv += set_args(p.overrides)
        log_file = self.out_dir / f"{_run_name('run', row.variant)}.log"
        code, out = launch(argv, log_file)
        row.exit_code = code
        run_dir = _run_dir_of(out)
        if run_dir is None or not (run_dir / META_FILE).exists():
            row.status = "failed"
            row.reason = _reason(log_file, code)
            return
        row.run_dir = str(run_dir)
        row.link = os.path.relpath(run_dir, self.out_dir)
        meta = read_json(run_dir / META_FILE)
        row.run_id = str(meta.get("run_id", run_dir.name))
        row.trace_sha256 = str((meta.get("trace") or {}).get("sha256") or "")
        row.platform = str(((meta.get("engine") or {}).get("details") or {}).get("platform") or "")
        if row.platform and not self.platform:
            self.platform = "cpu" if row.platform == "cpu" else "cuda"
        if (run_dir / VERDICT_FILE).exists():
            row.verdict = str(read_json(run_dir / VERDICT_FILE).get("verdict", ""))
        if code not in (0, 1):
            # A verdict may exist (FAIL), but the run did not end normally: its numbers are not the
            # variant's, and the row says why.
            row.status = "failed"
            row.reason = _reason(log_file, code)
            return
        row.status = "ran"
        row.metrics = load_metrics(run_dir)

    def _finish(self) -> None:
        """Deltas against the baseline row, then matrix.json and matrix.md (rewritten after each row)."""
        base = next((r for r in self.rows if r.variant == self.baseline), None)
        for r in self.rows:
            r.vs_baseline = {}
            if base is None or base.status != "ran" or r.status != "ran" or r is base:
                continue
            for d in compare_metrics(base.metrics, r.metrics, self.tolerance_pct):
                r.vs_baseline[d.name] = {"delta": d.delta, "rel": d.rel, "status": d.status}
        write_json_atomic(self.out_dir / MATRIX_JSON, self.to_dict())
        text = "\n".join(markdown(self)) + "\n"
        tmp = self.out_dir / f".{MATRIX_MD}.tmp"
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(self.out_dir / MATRIX_MD)

    def warnings(self) -> list[str]:
        base = next((r for r in self.rows if r.variant == self.baseline), None)
        out = []
        if base is None or base.status != "ran":
            out.append(f"the baseline ({self.baseline}) has no run: no deltas")
            return out
        for r in self.rows:
            if r.status == "ran" and r is not base:
                w = trace_warning(base.trace_sha256, r.trace_sha256)
                if w:
                    out.append(f"{r.variant}: {w}")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "matrix_dir": str(self.out_dir),
            "config": str(self.config_path) if self.config_path is not None else "<defaults>",
            "started_utc": self.started_utc,
            "baseline": self.baseline,
            "platform": self.platform,
            "tolerance_pct": self.tolerance_pct,
            "warnings": self.warnings(),
            "rows": [asdict(r) for r in self.rows],
        }


def _what(overrides: dict[str, Any]) -> str:
    return ", ".join(f"{k}={json.dumps(v)}" for k, v in flatten(overrides).items()) or "nothing"


def _run_dir_of(stdout: str) -> Path | None:
    try:
        doc = json.loads(stdout)
    except ValueError:
        return None
    run_dir = doc.get("run_dir") if isinstance(doc, dict) else None
    return Path(run_dir) if isinstance(run_dir, str) and run_dir else None


def _reason(log_file: Path, code: int) -> str:
    """The run's own one-line error (`soakd: ...` on stderr), else its exit code."""
    try:
        text = log_file.read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    said = [ln.strip() for ln in text.splitlines() if ln.startswith("soakd: ")]
    why = said[-1].removeprefix("soakd: ") if said else f"soakd run exited {code}"
    return f"exit {code}: {why}"[:300]


# The table's columns: header, metric, whether a delta is shown.
_COLUMNS = [
    ("decode tok/s", "tokens_per_s"),
    ("TTFT p50 ms as offered", "p50(ttft_offered_ms)"),
    ("TTFT p99 ms as offered", "p99(ttft_offered_ms)"),
    ("TPOT p50 ms", "p50(tpot_ms)"),
]


def _cell(row: Row, name: str) -> str:
    value = row.metrics.get(name)
    text = fmt_value(name, value)
    d = row.vs_baseline.get(name)
    if value is not None and d is not None:
        text += f" ({fmt_rel(d['rel'], d['delta'])})"
    return text


def _memory(row: Row) -> str:
    """Peak GPU memory on a GPU, the engine's peak RSS on the CPU build: the cell says which."""
    gpu, rss = row.metrics.get("peak_gpu_mem_bytes"), row.metrics.get("peak_engine_rss_bytes")
    if gpu is not None:
        return f"{fmt_bytes(gpu)} GPU"
    if rss is not None:
        return f"{fmt_bytes(rss)} RSS"
    return "-"


def markdown(m: Matrix) -> list[str]:
    """The matrix as a markdown table (also readable as text): one row per variant, deltas vs baseline."""
    header = ["variant", "what changed", *(c for c, _ in _COLUMNS), "peak memory", "verdict", "run"]
    rows = [header]
    for r in m.rows:
        if r.status == "ran":
            cells = [_cell(r, name) for _, name in _COLUMNS]
            mem, verdict = _memory(r), r.verdict or "-"
        else:
            cells, mem = ["-"] * len(_COLUMNS), "-"
            verdict = r.reason or r.status
        run = f"[{r.run_id}]({r.link})" if r.link else "-"
        rows.append([r.variant, r.what, *cells, mem, verdict.replace("|", "/"), run])
    widths = [max(len(x[i]) for x in rows) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    out = [
        "# Ablation matrix",
        "",
        f"Config: {m.config_path if m.config_path is not None else '<defaults>'}; platform: "
        f"{m.platform or 'unknown'}; deltas against `{m.baseline}` (within {m.tolerance_pct:g}% is noise). "
        "Decode tok/s: output tokens per second over the replay. Peak memory: GPU memory on a GPU, the "
        "engine processes' RSS on the CPU build.",
        "",
    ]
    out += [f"**Warning:** {w}" for w in m.warnings()]
    if m.warnings():
        out.append("")
    out.append(line(rows[0]))
    out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    out += [line(r) for r in rows[1:]]
    return out
