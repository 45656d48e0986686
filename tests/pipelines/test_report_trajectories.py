"""The report's sample browser shows a trajectory turn by turn, its tool/environment turns
marked as not trained: the round page's data, and the page in headless Chromium."""

from __future__ import annotations

import json

from pipelines.reports.html_page import write_html_report
from tests.curation.test_trajectory_curation import run  # noqa: F401  (the module's run fixture)
from tests.pipelines.test_html_report import CHROMIUM, browse, data


def test_a_trajectory_is_shown_turn_by_turn_with_its_masked_turns_marked(run, tmp_path):  # noqa: F811
    index = write_html_report(run, tmp_path / "report", rounds=[])
    page = data(tmp_path / "report" / "data" / "round-0-0.js")
    response = next(r for g in page["groups"] if g["prompt_id"] == "p0" for r in g["responses"] if r["idx"] == 0)
    assert [(t["role"], t["trained"]) for t in response["turns"]] == [
        ("assistant", True), ("tool", False), ("assistant", True)]
    assert response["turns"][1]["text"] == "[calculator] 42"
    if CHROMIUM:
        dom, _ = browse(index, "round=0")
        assert dom.count('class="turn masked"') == 5  # one per tool message of the round's trajectories
        assert "tool, not trained" in dom and "assistant, trained" in dom
    assert json.dumps(page).count('"trained": false') == 5
