"""`leanlm serve`: an OpenAI-compatible HTTP server over the engine (protocol, serving, metrics, api)."""
