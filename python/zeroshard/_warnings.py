"""Warnings that point at the user's line, not at zeroshard's own files.

A warning raised inside zeroshard (an ignored config key, a world-size notice) is about the
call the user made: its file and line are those of the first frame outside this package, as
Python 3.12's warnings.warn(skip_file_prefixes=...) would give.
"""

import os
import sys
import warnings

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_at_caller(message, category=UserWarning):
    """warnings.warn(message) attributed to the first frame outside zeroshard; also right when
    called from the C++ extension (the frame below it is then the Python code that called it)."""
    frame, level = sys._getframe(1), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
