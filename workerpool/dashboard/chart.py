"""The Overview's chart: jobs done and runs failed per minute over the last hour, drawn as
SVG on the server (pygal), without the tooltips script pygal would load from the internet."""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping

import pygal

# pygal adds an import hook for its map plugins (pygal.maps.*, not used here) that only has
# the find_module Python 3.12 drops: every import that misses after it warns (ImportWarning).
# Taken out, so importing the dashboard leaves the process's imports as they were.
sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, pygal.PluginImportFixer)]

# Drawn instead of bars by a store that counts neither.
NOT_COUNTED = "not counted by this store (SQLite counts them)"


def minutes_chart(series: Mapping[str, list[int] | None]) -> str:
    """An SVG of each series' counts (one a minute, oldest first, the last one now), a bar
    of each per minute, in order; a series that is None (its store does not count it) is
    left out, and with none counted the chart says so."""
    counted = {name: counts for name, counts in series.items() if counts is not None}
    chart = pygal.Bar(
        no_data_text=NOT_COUNTED,
        js=[],
        disable_xml_declaration=True,
        legend_at_bottom=True,
        height=240,
        width=800,
        x_title="minutes ago",
        y_title="per minute",
        show_minor_x_labels=False,
        truncate_label=-1,
    )
    if not counted:
        return str(chart.render(is_unicode=True))
    # Whole jobs on the y axis, about five lines of them (pygal would draw 0.2 steps).
    top = max(max(counts, default=0) for counts in counted.values())
    step = max(1, math.ceil(top / 5))
    chart.y_labels = list(range(0, top + step + 1, step))
    minutes = max(len(counts) for counts in counted.values())
    chart.x_labels = [str(minutes - 1 - i) for i in range(minutes)]
    chart.x_labels_major = [label for label in chart.x_labels if int(label) % 10 == 0]
    for name, counts in counted.items():
        chart.add(name, counts)
    svg: str = chart.render(is_unicode=True)
    return svg
