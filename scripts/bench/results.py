"""One scenario's result: what measuring fills in and reporting shows (and writes as
JSON, field by field)."""

from __future__ import annotations

import statistics
from typing import Any

import attrs


@attrs.define
class Result:
    scenario: str
    unit: str
    runs: list[float]
    sync: str = "full"
    peak_rss_mb: float | None = None
    mean_batch: float | None = None
    extra: dict[str, Any] = attrs.Factory(dict)

    @property
    def median(self) -> float:
        return statistics.median(self.runs) if self.runs else float("nan")
