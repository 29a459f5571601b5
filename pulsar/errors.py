"""User-facing errors.

Anything the user can fix (a bad config field, a missing file, a tensor name that is not in the
model) raises :class:`PulsarError`. The CLI prints its message on one line and exits with code 2;
only ``--debug`` shows a traceback. Internal bugs stay ordinary exceptions.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class PulsarError(Exception):
    """An error caused by user input; the message names the file / field / tensor and the fix."""

    exit_code = 2


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """Return ' (did you mean "x"?)' for the closest candidate, or '' when none is close."""
    matches = difflib.get_close_matches(str(word), [str(c) for c in candidates], n=1, cutoff=0.6)
    return f' (did you mean "{matches[0]}"?)' if matches else ""
