"""The HTTP server: the Flask app factory (``app.py``) and its routes (OpenAI
routes, the Batch API, SSE, job routes, ``/openapi.json``, metrics, dashboard).
What runs it and everything a user runs live in ``tools/``."""
