"""The library version, one place: the wire fingerprint and the package both read it."""

__version__ = "0.1.0"
