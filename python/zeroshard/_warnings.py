"""Warnings that point at the user's line, not at zeroshard's own files, said once per job.

A warning raised inside zeroshard (an ignored config key, a world-size notice) is about the
call the user made: its file and line are those of the first frame outside this package, as
Python 3.12's warnings.warn(skip_file_prefixes=...) would give.

Note [rank-0 warnings]: every rank runs the same script, so a warning about that script (a
config key every rank read) would be printed once per rank, N copies of one line. It is warned
on rank 0 only; other ranks skip it before the warnings machinery sees it. A warning about one
rank (its own device, its own files) passes every_rank=True and is warned where it happens;
warnings the C++ core made come with that choice made (it knows its engine's rank).
"""

import os
import sys
import warnings

from zeroshard._rank import this_rank

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_at_caller(message, category=UserWarning, every_rank=False):
    """warnings.warn(message) attributed to the first frame outside zeroshard; also right when
    called from the C++ extension (the frame below it is then the Python code that called it).
    On rank 0 only unless every_rank (Note [rank-0 warnings])."""
    if not every_rank and this_rank() != 0:
        return
    frame, level = sys._getframe(1), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
