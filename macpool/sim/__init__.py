"""A llama-server-compatible simulator of a Mac with unified memory."""

from macpool import __version__

__all__ = ["__version__"]
