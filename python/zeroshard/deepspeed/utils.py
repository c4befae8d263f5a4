"""deepspeed.utils as scripts use it: RepeatingLoader, and a logger (zeroshard's)."""

import logging

from zeroshard.deepspeed.dataloader import RepeatingLoader  # noqa: F401

logger = logging.getLogger("zeroshard")
