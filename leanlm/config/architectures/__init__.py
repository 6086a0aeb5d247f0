"""One module per architecture family (what it is, as data: leanlm.config.architectures.spec) and the registry that
names them; `docs/architecture.md` ("How to add a model") walks through adding one."""

from leanlm.config.architectures.registry import (
    ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    by_gguf_name,
    get_architecture,
)
from leanlm.config.architectures.spec import Architecture

__all__ = ["ARCHITECTURES", "SUPPORTED_ARCHITECTURES", "Architecture", "by_gguf_name", "get_architecture"]
