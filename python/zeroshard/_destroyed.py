"""What stands where an engine's parts were once destroy() released them."""


class Destroyed:
    """Any use of it raises a RuntimeError that says the engine was destroyed, where the released
    object would otherwise fail deep inside (an AttributeError on None, a C++ engine missing).
    Dunder lookups (copy, pickle, repr protocols) are plain AttributeErrors, so probing it does
    not raise."""

    __slots__ = ("_what", "_instead")

    def __init__(self, what, instead):
        object.__setattr__(self, "_what", what)
        object.__setattr__(self, "_instead", instead)

    def error(self, name):
        """The error for a use of `name` (for callers that check before touching it)."""
        return RuntimeError(f"{self._what} was destroyed (engine.destroy() released its sharded state and removed "
                            f"its hooks), so '{name}' cannot be used; {self._instead}")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise self.error(name)

    def __setattr__(self, name, value):
        raise self.error(name)

    def __call__(self, *args, **kwargs):
        raise self.error("__call__")

    def __repr__(self):
        return f"<{self._what}: destroyed>"
