"""macpool: an honest OpenAI-compatible endpoint over a pool of Macs running llama-server."""

__version__ = "0.1.0"
