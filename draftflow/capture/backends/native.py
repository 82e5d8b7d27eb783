"""vLLM's built-in extractor: speculative method ``extract_hidden_states`` + a KV connector."""

from __future__ import annotations

from packaging.version import Version

NATIVE_MIN_VERSION = "0.17"


def native_supports(vllm_version: str) -> bool:
    return Version(Version(vllm_version).base_version) >= Version(NATIVE_MIN_VERSION)


class NativeBackend:
    name = "native"

    def __init__(self, *args, **kwargs) -> None:
        raise NotImplementedError("extract.backend native is not implemented yet: use hooks or hf")
