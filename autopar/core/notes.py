"""Why a search left something out: said once, both to the log and to the plan's record."""

from __future__ import annotations

import logging


def note(log: logging.Logger, notes: list[str] | None, msg: str, *args: object) -> None:
    """Log ``msg % args`` at INFO on ``log`` and add it to ``notes`` when given."""
    log.info(msg, *args)
    if notes is not None:
        notes.append(msg % args)
