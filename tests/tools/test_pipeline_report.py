"""`ndtrain pipeline-report`'s measured path: ranks trained through train/pipeline_trace.py's trace_steps,
the one function that knows the pipeline's trace fields (the tool reads none of them)."""

from __future__ import annotations

import inspect

import pytest

from ndtrain.config import load_config
from ndtrain.tools import pipeline_report


@pytest.mark.timeout(300)
def test_measured_ranks_time_every_step_and_summarize(parity_base):
    base = {k: dict(v) for k, v in parity_base.items()}
    base["train"].update(micro_batch=2)
    cfg = load_config(None, {**base, "parallel": {"pp": 2, "dp_shard": 1, "pp_schedule": "1F1B"}})
    ranks = pipeline_report.timed_actions(cfg, 2, 2)
    assert sorted(r["rank"] for r in ranks) == [0, 1] and sorted(s for r in ranks for s in r["stages"]) == [0, 1]
    for r in ranks:
        assert len(r["traces"]) == len(r["losses"]) == 2  # one timeline per step trained
        assert {e[1] for e in r["traces"][-1]["events"]} >= {"F", "B"} and r["traces"][-1]["m"] == 4  # (stage, kind, ...)
    assert ranks[0]["losses"] == ranks[1]["losses"]
    s = pipeline_report.summarize(ranks, "1F1B", 2, 1)
    assert s["steps"] == [1] and 0 < s["mean_idle"] < 1 and s["stages"] == {0: [0], 1: [1]}


def test_the_tool_holds_no_knowledge_of_the_pipeline_fields():
    source = inspect.getsource(pipeline_report)
    for reach in (".pipeline.", ".rt.", "trainer.pipeline"):
        assert reach not in source, reach
