"""A llama-server-compatible simulator of a Mac with unified memory."""
