"""vLLM's built-in extractor (vLLM >= 0.22: the connector helpers it reads arrive there): speculative method ``extract_hidden_states``.

vLLM stores the states entering the configured layers (same ids as ours: k = the stream after k
layers, L = the final pre-norm output) in a KV-cache slot, and a KV connector writes one
safetensors file per request (``hidden_states [T, layers, H]``, ``token_ids [T]``). On GPUs
that is vLLM's stock ``ExampleHiddenStatesConnector`` (asynchronous copies and writes); on the
CPU build ``draftflow.capture.adapters.native_connector.SyncHiddenStatesConnector``, which does
the same work synchronously (the stock one needs pinned memory). The connector needs each prompt
in one forward: chunked prefill is off, so ``max_num_batched_tokens`` is raised to
``max_model_len`` where it is lower. vLLM 0.24 runs this speculative method under the V1 model
runner only (its V2 runner refuses it), so ``model_runner: default`` means V1 below
``NATIVE_V2_MIN_VERSION`` (0.33: the GPU lane ran the method under Model Runner V2 there); from it
on the engine keeps vLLM's own default runner.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import torch
from packaging.version import Version

from draftflow.capture.backends import (
    CaptureEngineSettings,
    capture_engine_env,
    capture_engine_kwargs,
)
from draftflow.capture.layers import text_config
from draftflow.engine import (
    describe_model,
    engine_failure,
    generate_as_one_call,
    hold_first_step,
    installed_vllm_version,
    on_cpu_build,
    shutdown_engine,
    start_engine,
)
from draftflow.io import read_json

log = logging.getLogger(__name__)

# The extractor's connector module gains load_hidden_states / cleanup_hidden_states, which
# capture() imports, in 0.22 (tools/vllm_contract.py reads them in every release's wheel).
NATIVE_MIN_VERSION = "0.22"
# The oldest vLLM seen capturing an MLA target (DeepSeek-V3, Kimi-K2.5) with its extractor: 0.32
# (CPU build). On GPUs 0.24 fails at the first forward: its hidden-state cache takes the MLA
# KV cache's layout (tests/gpu/test_gpu_families.py).
NATIVE_MLA_MIN_VERSION = "0.32"
# The oldest vLLM whose Model Runner V2 a GPU lane saw capturing with the extractor
# (tests/gpu: test_native_matches_hf[v2], 2026-12-06 on 0.33.0; 0.32 is untested there). Below it
# ``default`` means V1.
NATIVE_V2_MIN_VERSION: str | None = "0.33"
CPU_CONNECTOR_MODULE = "draftflow.capture.adapters.native_connector"
CPU_CONNECTOR_CLASS = "SyncHiddenStatesConnector"
GPU_CONNECTOR_CLASS = "ExampleHiddenStatesConnector"


def native_supports(vllm_version: str) -> bool:
    return Version(Version(vllm_version).base_version) >= Version(NATIVE_MIN_VERSION)


def is_mla_target(model_dir: str | os.PathLike[str]) -> bool:
    """Whether the target's text model uses multi-head latent attention (DeepSeek-V3 family)."""
    config = text_config(read_json(Path(model_dir) / "config.json"))
    return bool(config.get("kv_lora_rank"))


def native_refusal(model_dir: str | os.PathLike[str], vllm_version: str, cpu_build: bool) -> str:
    """Why this vLLM's extractor cannot capture this target here ("" where it can)."""
    if not native_supports(vllm_version):
        return (
            f"extract.backend native needs vLLM >= {NATIVE_MIN_VERSION}; installed: {vllm_version}"
        )
    too_old = Version(Version(vllm_version).base_version) < Version(NATIVE_MLA_MIN_VERSION)
    if is_mla_target(model_dir) and too_old and not cpu_build:
        return (
            f"extract.backend native: vLLM {vllm_version}'s extract_hidden_states cannot capture "
            f"{describe_model(model_dir)} on GPUs: its hidden-state cache takes the layout of the "
            "target's MLA (multi-head latent attention) KV cache and the first forward fails; "
            f"vLLM >= {NATIVE_MLA_MIN_VERSION} captures MLA targets, extract.backend hooks "
            "captures them with any vLLM"
        )
    return ""


def native_model_runner(model_runner: str, vllm_version: str) -> str:
    """The runner the extractor's engine is started with: vLLM 0.24's Model Runner V2 refuses
    this speculative method, so below ``NATIVE_V2_MIN_VERSION`` the default is V1."""
    if model_runner != "default":
        return model_runner
    if NATIVE_V2_MIN_VERSION is None:
        return "v1"
    old = Version(Version(vllm_version).base_version) < Version(NATIVE_V2_MIN_VERSION)
    return "v1" if old else "default"


class NativeBackend:
    name = "native"

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        layer_ids: list[int],
        settings: CaptureEngineSettings,
    ) -> None:
        self.vllm_version = installed_vllm_version()
        if self.vllm_version is None:
            raise RuntimeError(f"extract.backend native needs vLLM >= {NATIVE_MIN_VERSION}")
        refusal = native_refusal(model_dir, self.vllm_version, on_cpu_build())
        if refusal:
            raise RuntimeError(refusal)
        self.layer_ids = list(layer_ids)
        self._tmp = tempfile.TemporaryDirectory(prefix="draftflow-native-")
        kwargs = capture_engine_kwargs(model_dir, settings)
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(
            settings.max_num_batched_tokens, settings.max_model_len
        )
        connector = {"kv_connector": GPU_CONNECTOR_CLASS}
        if on_cpu_build():
            connector = {
                "kv_connector": CPU_CONNECTOR_CLASS,
                "kv_connector_module_path": CPU_CONNECTOR_MODULE,
            }
        kwargs["speculative_config"] = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {
                "hf_config": {"eagle_aux_hidden_state_layer_ids": self.layer_ids}
            },
        }
        kwargs["kv_transfer_config"] = {
            **connector,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": self._tmp.name},
        }
        # The KV connector makes the CPU build keep no scheduler core unless told.
        runner = native_model_runner(settings.model_runner, self.vllm_version)
        env = capture_engine_env(settings, runner)
        self.llm = start_engine(kwargs, env)
        self.hold_first_step = hold_first_step(self.llm, env, settings.deterministic)
        self.last_stats: dict = {}

    def capture(self, token_ids: list[list[int]]) -> list[torch.Tensor]:
        from vllm import SamplingParams
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
            load_hidden_states,
        )
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in ids]) for ids in token_ids]
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        try:
            if self.hold_first_step:
                outputs = generate_as_one_call(self.llm, prompts, [params] * len(prompts))
            else:
                outputs = self.llm.generate(prompts, params, use_tqdm=False)
        except Exception as error:
            raise engine_failure(self.llm, error) from error
        results = []
        for output, ids in zip(outputs, token_ids, strict=True):
            path = (output.kv_transfer_params or {}).get("hidden_states_path")
            if path is None:
                raise RuntimeError(f"request {output.request_id}: the connector wrote no states")
            # The worker writes the file a step after the request finished; this waits on the
            # connector's lock file until it is complete.
            data = load_hidden_states(path)
            cleanup_hidden_states(path)
            if data["token_ids"].tolist() != list(ids):
                raise RuntimeError(f"request {output.request_id}: token ids differ from the prompt")
            states = data["hidden_states"]
            if tuple(states.shape[:2]) != (len(ids), len(self.layer_ids)):
                raise RuntimeError(
                    f"request {output.request_id}: states of shape {tuple(states.shape)}, "
                    f"expected [{len(ids)}, {len(self.layer_ids)}, H]"
                )
            results.append(states)
        return results

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            shutdown_engine(llm)
        self._tmp.cleanup()
