"""The report's rows on other processes on the engine's GPUs (report.gpus.cotenant_rows)."""

from __future__ import annotations

from soakd.report.gpus import cotenant_rows, engine_gpu_rows


def test_other_processes_on_the_engines_gpus_are_said_where_known() -> None:
    def summary(*counts: int | None) -> dict[str, object]:
        return {"gpu_throttle": {str(g): {"cotenant_episodes": n} for g, n in enumerate(counts)}}

    assert cotenant_rows(summary(0, 0)) == [("other processes", "none on GPU(s) 0, 1")]
    assert cotenant_rows(summary(0, 2)) == [
        (
            "other processes, GPU 1",
            "came 2 time(s) (cotenant_enter events); the figures are not the engine's alone",
        )
    ]
    # Unknown (NVML's list never named the engine's processes), or a summary from before: unsaid.
    assert cotenant_rows(summary(None)) == [] and cotenant_rows({"gpu_throttle": {"0": {}}}) == []
    assert cotenant_rows({}) == []
    rows = engine_gpu_rows({"engine": {"gpus": [0], "known": True, "replicas": [[0]]}}, summary(1))
    assert [k for k, _ in rows] == ["the engine's GPUs", "other processes, GPU 0"]
