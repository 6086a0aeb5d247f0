"""The loading tests' fixtures (the cache kept out of ~/.cache, the bundled model's directory, a tiny GGUF file):
format tests read the same files."""

from tests.loading.conftest import leanlm_cache, smollm_dir, tiny_gguf  # noqa: F401 (fixtures)
