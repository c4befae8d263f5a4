"""The engine's progress lines (steps_per_print, wall_clock_breakdown) into the `zeroshard`
logger. The C++ engine formats each line and calls the sink on rank 0 only, after the
optimizer step of every steps_per_print-th boundary (docs/config.md, "Logging")."""

from zeroshard._log import get_logger


def wire_logging(core):
    """Sends `core`'s progress lines to logging.getLogger("zeroshard").info, which prints to
    stdout unless the application configured that logger or the root logger itself."""
    core.set_log_sink(get_logger().info)
