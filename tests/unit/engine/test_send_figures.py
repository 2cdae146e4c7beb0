"""The replay's send figures an HTTP engine reports: stamped requests only, thresholds, the slowest."""

from __future__ import annotations

from soakd.engine.completions import SendFigures


def test_only_stamped_requests_count_and_the_slowest_is_kept() -> None:
    figures = SendFigures()
    figures.add(None, 1.0, True)  # never sent
    figures.add(1.0, None, True)  # sent, never written (failed before its bytes left)
    figures.add(1.0, 1.0005, False)
    figures.add(2.0, 2.004, True)
    figures.add(3.0, 3.0251, True)
    figures.warmed = 32
    assert figures.summary() == {
        "requests": 3,
        "connections_warmed": 32,
        "connections_opened": 2,
        "write_max_ms": 25.1,
        "write_over_1ms": 2,
        "write_over_10ms": 1,
    }
