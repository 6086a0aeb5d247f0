"""`leanlm serve`: an OpenAI-compatible HTTP server over the engine (protocol, serving, metrics, api).

The public pieces other HTTP processes (the fleet's front, leanlm/fleet/) build on are named here; importing them
loads neither the engine nor a model."""

from leanlm.server.error_body import error_response
from leanlm.server.guard import GuardMiddleware
from leanlm.server.http_config import uvicorn_config
from leanlm.server.protocol import MAX_MESSAGES, MAX_PROMPTS

__all__ = ["MAX_MESSAGES", "MAX_PROMPTS", "GuardMiddleware", "error_response", "uvicorn_config"]
