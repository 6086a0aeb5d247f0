"""The base of every request schema: strict types, unknown fields ignored (vLLM does the same, so clients that send
newer parameters keep working), and no Infinity or NaN."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    # allow_inf_nan=False: pydantic's JSON parser reads Infinity and NaN, and an infinite penalty turns a zero
    # logit into NaN; every float field of every schema refuses them.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
