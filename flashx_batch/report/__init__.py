"""The human summary of a finished job: `report.md` plus PNG plots next to it."""

from flashx_batch.report.markdown import write_report

__all__ = ["write_report"]
