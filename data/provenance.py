"""Where a training batch came from, in one line: the documents (records) that fill its rows.

Loaders keep the document ids of their last batch (`provenance()`), so a fault reported for a step
(a non-finite loss, a loss spike) names the data that caused it.
"""

from collections.abc import Sequence

SHOWN = 6  # documents named; the rest are counted


def describe(names: Sequence[str]) -> str:
    """'a, b, c, ... (+12 more)' for the distinct document names of a batch, in order."""
    names = list(dict.fromkeys(names))
    if not names:
        return "no documents"
    shown = ", ".join(names[:SHOWN])
    return shown if len(names) <= SHOWN else f"{shown} (+{len(names) - SHOWN} more)"
