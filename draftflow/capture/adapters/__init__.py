"""vLLM-internals adapters, one per vLLM version range (see ``select_adapter``)."""

from __future__ import annotations

from draftflow.capture.adapters.v1_runner import V1RunnerAdapter


def select_adapter(vllm_version: str) -> type[V1RunnerAdapter]:
    """The adapter for an installed vLLM version, or a clear error naming the supported ones."""
    if V1RunnerAdapter.supports(vllm_version):
        return V1RunnerAdapter
    raise RuntimeError(
        f"extract.backend 'hooks' does not support vLLM {vllm_version}: supported are "
        f"{V1RunnerAdapter.VERSIONS} ({V1RunnerAdapter.__doc__.splitlines()[0]}); "
        "use backend 'native' (vLLM >= 0.17) or 'hf'"
    )
