"""The `zeroshard` logger: rank-0 information lines (what each "auto" became, the training log
of steps_per_print). It prints to stdout unless the application configured it (or the root
logger) itself."""

import logging
import sys

_NAME = "zeroshard"


def get_logger():
    logger = logging.getLogger(_NAME)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        # The root logger has no handler here; not propagating avoids logging's last-resort
        # stderr copy of every line.
        logger.propagate = False
    if logger.level == logging.NOTSET:  # the application did not choose: information lines show
        logger.setLevel(logging.INFO)
    return logger
