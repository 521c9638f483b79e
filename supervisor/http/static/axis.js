// The dashboard chart's y axis (supervisor/http/dashboard.py serves this file; dashboard.js
// calls chartAxis; tests/test_dashboard_axis.py runs it under node, the browser test in a page).
//
// Why adaptive: an axis from 0 to the ceiling put a 300 MiB model under a 20 GiB ceiling in
// the bottom 1.5 % of the chart, flat on the floor. The axis follows what is used while the
// watermarks are far (their values are said in a label at the top edge), and spans up to the
// ceiling once usage comes within reach of the soft watermark, when the lines that matter are
// the watermarks.

"use strict";

// Usage at or above this share of the soft watermark brings the ceiling into the chart.
const NEAR_SOFT = 1 / 3;
// Room above the highest line.
const HEADROOM = 1.25;

// peak: the highest usage drawn in the window (bytes); marks: {ceiling, hard, soft} in force
// (0 = none, the guard off). Returns {top, shown, above}: the axis runs from 0 to `top`;
// `shown` names the marks inside it (drawn as lines), `above` those over it (said in words).
function chartAxis(peak, marks) {
  const floor = 1024 * 1024;
  const soft = marks.soft || 0, ceiling = marks.ceiling || 0;
  let top = Math.max(peak * HEADROOM, floor);
  if (ceiling > 0 && peak >= NEAR_SOFT * (soft || ceiling)) top = Math.max(top, ceiling * 1.05);
  const shown = [], above = [];
  for (const name of ["ceiling", "hard", "soft"]) {
    const value = marks[name] || 0;
    if (value <= 0) continue;
    (value <= top ? shown : above).push(name);
  }
  return { top, shown, above };
}

if (typeof module !== "undefined") module.exports = { chartAxis, NEAR_SOFT, HEADROOM };
