"""The stat-logger plugin and soakd's end of its socket; the server command line."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from soakd.config import EngineConfig
from soakd.engine.base import SpecSteps
from soakd.engine.channel import SOCKET_ENV, StepChannel
from soakd.engine.stats import StepStats, copy_spec_steps, step_from_wire, step_to_wire
from soakd.engine.vllm_server import model_config_vocab, server_argv, server_config_id


def test_wire_format_round_trips() -> None:
    step = StepStats(
        time_ns=5,
        engine_idx=1,
        running=3,
        kv_cache_usage=0.5,
        has_spec=True,
        spec_accepted_per_pos=(2, 1),
        spec_draft_tokens_per_pos=(3, 3),
        cg_mode="FULL",
    )
    back = step_from_wire(json.loads(json.dumps(step_to_wire(step))))
    assert back == step
    with pytest.raises(ValueError):
        step_from_wire([1, 2])


async def _received(channel: StepChannel, n: int) -> None:
    deadline = asyncio.get_running_loop().time() + 60  # a hang guard only
    while asyncio.get_running_loop().time() < deadline:
        if channel.stats.steps + channel.stats.malformed >= n:
            return
        await asyncio.sleep(0.005)  # poll interval


async def test_channel_counts_steps_gaps_and_bad_datagrams() -> None:
    got: list[StepStats] = []
    channel = StepChannel(got.append, clock_ns=lambda: 42)
    await channel.open()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(channel.path)
            s.sendall(json.dumps({"hello": {"cpu": True}, "pid": 7}).encode() + b"\n")
            for seq in (1, 2, 5):  # 3 and 4 never arrive
                msg = {
                    "s": step_to_wire(StepStats(time_ns=0, running=seq)),
                    "q": seq,
                    "c": 1000 * seq,
                    "pid": 7,
                }
                s.sendall(json.dumps(msg).encode() + b"\n")
            s.sendall(b"not json\n")
        await _received(channel, 4)
    finally:
        await channel.aclose()
    assert [s.running for s in got] == [1, 2, 5] and all(s.time_ns == 42 for s in got)
    assert channel.facts() == {"cpu": True}
    summary = channel.summary()
    assert summary["lost"] == 2 and summary["malformed"] == 1 and summary["record_us_max"] == 5.0


async def test_the_plugin_sends_each_step_to_the_socket_named_in_its_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("vllm")
    from soakd.engine.plugin import SoakdStatLogger

    got: list[StepStats] = []
    channel = StepChannel(got.append)
    await channel.open()
    try:
        vcfg = SimpleNamespace()  # facts that cannot be read are reported as an error, not raised
        monkeypatch.delenv(SOCKET_ENV, raising=False)
        silent = SoakdStatLogger(vcfg, 0)
        silent.record(None, None)  # no socket: nothing happens
        monkeypatch.setenv(SOCKET_ENV, channel.path)
        logger = SoakdStatLogger(vcfg, 0)
        sched = SimpleNamespace(
            num_running_reqs=4,
            num_waiting_reqs=1,
            kv_cache_usage=0.25,
            prefix_cache_stats=None,
            spec_decoding_stats=SimpleNamespace(
                num_drafts=2,
                num_draft_tokens=6,
                num_accepted_tokens=4,
                num_accepted_tokens_per_pos=[2, 1, 1],
                num_draft_tokens_per_pos=[2, 2, 2],
            ),
            cudagraph_stats=None,
        )
        for _ in range(3):
            logger.record(sched, None)
        await _received(channel, 3)
    finally:
        await channel.aclose()
    assert len(got) == 3 and got[0].running == 4 and got[0].spec_accepted_per_pos == (2, 1, 1)
    assert "error" in channel.facts()
    assert channel.stats.lost == 0 and channel.stats.cost.n == 2  # the cost rides on the next step


def test_server_argv_carries_the_engine_config() -> None:
    cfg = EngineConfig(
        kind="vllm-server",
        max_num_seqs=8,
        enforce_eager=True,
        enable_prefix_caching=False,
        extra_args={"compilation_config": {"cudagraph_capture_sizes": [1, 2]}, "max_num_batched_tokens": 512},
        server={"extra_flags": ["--api-server-count", "1"]},
    )
    argv = server_argv(cfg, "/m", 8123, known_args=None)
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(argv)
    assert "--model /m" in joined and "--port 8123" in joined and "--max-num-seqs 8" in joined
    assert "--enforce-eager" in argv and "--no-enable-prefix-caching" in argv
    assert argv[argv.index("--compilation-config") + 1] == '{"cudagraph_capture_sizes":[1,2]}'
    assert argv[argv.index("--speculative-config") + 1].startswith('{"method":"ngram"')
    assert "--per-request-spec-decode-metrics" in argv and argv[-2:] == ["--api-server-count", "1"]
    assert "--disable-log-stats" not in argv  # the deployed server's own logging stays as it is
    # A release that lacks soakd's optional telemetry flags still starts, without them.
    old = server_argv(cfg, "/m", 8123, known_args={"max_num_seqs"})
    assert "--cudagraph-metrics" not in old and "--worker-extension-cls" not in old
    serve = server_argv(
        cfg.model_copy(update={"server": cfg.server.model_copy(update={"command": ["vllm", "serve"]})}),
        "/m",
        1,
    )
    assert serve[:3] == ["vllm", "serve", "/m"]
    assert server_config_id(argv) == server_config_id(server_argv(cfg, "/m", 9999, known_args=None))


def test_per_request_spec_metrics_from_object_or_json() -> None:
    out = SpecSteps()
    copy_spec_steps(SimpleNamespace(per_step_accepted=[3, 1], per_step_drafted=[3, 3]), out)
    assert (out.accepted, out.drafted) == ([3, 1], [3, 3])
    copy_spec_steps({"per_step_accepted": [0], "per_step_drafted": [2]}, out)
    assert (out.accepted, out.drafted) == ([0], [2])
    copy_spec_steps({"acceptance_histogram": [1, 2]}, out)  # summary level: nothing per step
    assert (out.accepted, out.drafted) == ([0], [2])


def test_stopping_a_server_whose_leader_exited_still_stops_its_children(tmp_path: Path) -> None:
    import subprocess
    import time

    import psutil

    from soakd.engine.vllm_server import _stop_group

    pidfile = tmp_path / "child.pid"
    # The group leader exits at once and leaves a child behind, as a crashed API server leaves its
    # engine core.
    proc = subprocess.Popen(
        ["bash", "-c", f"sleep 300 & echo $! > {pidfile}; exit 0"], start_new_session=True
    )
    proc.wait(timeout=10)
    for _ in range(100):
        if pidfile.exists() and pidfile.read_text().strip():
            break
        time.sleep(0.02)  # poll for the child's pid file
    child = int(pidfile.read_text())
    assert psutil.pid_exists(child)
    _stop_group(proc, 1.0)
    for _ in range(100):
        if not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE:
            break
        time.sleep(0.02)  # poll for the child to go
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_the_vocabulary_of_a_model_folder_without_the_plugin(tmp_path: Path) -> None:
    """Server mode without soakd's plugin takes the size from the model's config, never a probe."""
    (tmp_path / "config.json").write_text('{"vocab_size": 512}')
    assert model_config_vocab(tmp_path) == 512
    # A multimodal model's text config sizes the embedding vLLM builds.
    (tmp_path / "config.json").write_text('{"vocab_size": 257152, "text_config": {"vocab_size": 262208}}')
    assert model_config_vocab(tmp_path) == 262208
    for bad in ('{"vocab_size": true}', '{"vocab_size": "512"}', "[512]", "not json"):
        (tmp_path / "config.json").write_text(bad)
        assert model_config_vocab(tmp_path) is None
    assert model_config_vocab(tmp_path / "absent") is None  # a hub id, not a folder
