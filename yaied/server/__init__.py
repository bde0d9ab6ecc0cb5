"""The HTTP server: an OpenAI-compatible, streaming-first API over one AsyncEngine."""
