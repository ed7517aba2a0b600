"""The HTTP side of parkq: OpenAI-compatible routes, SSE, job routes, the CLI."""
