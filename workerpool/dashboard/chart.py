"""The Overview's chart: jobs done per minute over the last hour, drawn as SVG on the server
(pygal), without the tooltips script pygal would load from the internet."""

from __future__ import annotations

import math
import sys

import pygal

# pygal adds an import hook for its map plugins (pygal.maps.*, not used here) that only has
# the find_module Python 3.12 drops: every import that misses after it warns (ImportWarning).
# Taken out, so importing the dashboard leaves the process's imports as they were.
sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, pygal.PluginImportFixer)]

# Drawn instead of bars by a store that cannot count completions by time.
NOT_COUNTED = "not counted by this store (SQLite counts them)"


def done_chart(counts: list[int] | None) -> str:
    """An SVG of ``counts`` (one a minute, oldest first, the last one now); None: a chart
    saying they are not counted."""
    chart = pygal.Bar(
        no_data_text=NOT_COUNTED,
        js=[],
        disable_xml_declaration=True,
        show_legend=False,
        height=220,
        width=800,
        x_title="minutes ago",
        y_title="jobs done",
        show_minor_x_labels=False,
        truncate_label=-1,
    )
    if counts is None:
        return str(chart.render(is_unicode=True))
    # Whole jobs on the y axis, about five lines of them (pygal would draw 0.2 steps).
    step = max(1, math.ceil(max(counts, default=0) / 5))
    chart.y_labels = list(range(0, max(counts, default=0) + step + 1, step))
    chart.x_labels = [str(len(counts) - 1 - i) for i in range(len(counts))]
    chart.x_labels_major = [label for label in chart.x_labels if int(label) % 10 == 0]
    chart.add("done", counts)
    svg: str = chart.render(is_unicode=True)
    return svg
