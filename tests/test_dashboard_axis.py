"""The dashboard chart's y axis (supervisor/http/static/axis.js), run as written under node.

An axis from 0 to the ceiling put a 300 MiB model under a 20 GiB ceiling in the bottom 1.5 %
of the chart: the axis follows what is used while the watermarks are far (named at its top
edge), and takes in the ceiling once usage nears the soft watermark. The browser test
(tests/live/test_browser_dashboard_live.py) checks the same in a page during a drill."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from supervisor.http.dashboard import STATIC, read_static

NODE = shutil.which("node")
MiB, GiB = 1 << 20, 1 << 30
FAR = {"ceiling": 20 * GiB, "hard": 19 * GiB, "soft": 18 * GiB}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The script as the front door serves it, in a file node can require."""
    path = tmp_path_factory.mktemp("ui") / "axis.js"
    path.write_bytes(read_static("axis.js"))
    return path


def axis(served, peak: int, marks: dict[str, int]) -> dict:
    script = ("const {chartAxis} = require(process.argv[1]);"
              "console.log(JSON.stringify(chartAxis(Number(process.argv[2]), JSON.parse(process.argv[3]))));")
    out = subprocess.run([NODE, "-e", script, str(served), str(peak), json.dumps(marks)], capture_output=True,
                         text=True, timeout=30, check=True)
    return json.loads(out.stdout)


pytestmark = pytest.mark.skipif(NODE is None, reason="needs node to run the page's script")


def test_a_small_model_under_a_far_ceiling_fills_the_chart_and_the_watermarks_are_named_above(served):
    got = axis(served, 300 * MiB, FAR)
    assert 300 * MiB < got["top"] <= 2 * 300 * MiB  # the line sits in the upper half, not on the floor
    assert got["shown"] == [] and got["above"] == ["ceiling", "hard", "soft"]


def test_usage_near_the_soft_watermark_brings_the_ceiling_and_watermarks_into_the_chart(served):
    got = axis(served, 7 * GiB, FAR)
    assert got["top"] >= FAR["ceiling"] and got["shown"] == ["ceiling", "hard", "soft"] and got["above"] == []


def test_usage_over_the_ceiling_stays_in_the_chart(served):
    got = axis(served, 25 * GiB, FAR)
    assert got["top"] > 25 * GiB and got["shown"] == ["ceiling", "hard", "soft"]


def test_with_the_guard_off_the_axis_follows_usage_alone(served):
    got = axis(served, 300 * MiB, {"ceiling": 0, "hard": 0, "soft": 0})
    assert 300 * MiB < got["top"] <= 600 * MiB and got["shown"] == got["above"] == []


def test_the_page_loads_the_axis_before_the_script_that_draws_with_it():
    page = read_static("dashboard.html").decode()
    assert "axis.js" in STATIC and page.index("/ui/axis.js") < page.index("/ui/dashboard.js")
    assert "chartAxis(" in read_static("dashboard.js").decode()
