"""vLLM backend with forward hooks (``draftflow.capture.worker_extension``), vLLM 0.16 - 0.32,
under the V1 model runner and Model Runner V2.

Prefill only: each prompt is sent as token ids with ``max_tokens=1`` and a file key in its
``SamplingParams.extra_args``. The worker files each request's states into that file under a
directory the driver owns (in ``/dev/shm`` where it has room, so the files are memory); the
driver maps each finished file as a tensor (no copy), deletes it and hands it on while the
engine still runs (``capture_iter``). Tensors inside a ``collective_rpc`` reply would come back
as lists, hence files.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from draftflow.capture.adapters import check_hooks_version
from draftflow.capture.backends import (
    CaptureEngineSettings,
    capture_engine_env,
    capture_engine_kwargs,
)
from draftflow.capture.quant import Quantized
from draftflow.capture.recorder import RequestFile, map_request_file
from draftflow.capture.worker_extension import FILE_KEY
from draftflow.engine import (
    engine_failure,
    generate_as_one_call,
    hold_first_step,
    installed_vllm_version,
    shutdown_engine,
    start_engine,
)

log = logging.getLogger(__name__)

EXTENSION = "draftflow.capture.worker_extension.HiddenStateCaptureExtension"
# Capture files go to shared memory when it has at least this much room.
SHM = Path("/dev/shm")
SHM_MIN_FREE = 4 << 30
TMPDIR_ENV = "DRAFTFLOW_CAPTURE_TMPDIR"
# How often the driver looks for the next prompt's file while the engine runs.
POLL_S = 0.002


def capture_tmp_root() -> str | None:
    """Where the worker's per-request files go: ``$DRAFTFLOW_CAPTURE_TMPDIR``, else /dev/shm
    when it has room, else the system's temporary directory (None)."""
    configured = os.environ.get(TMPDIR_ENV)
    if configured:
        return configured
    if SHM.is_dir() and shutil.disk_usage(SHM).free >= SHM_MIN_FREE:
        return str(SHM)
    return None


def match_request_ids(internal_ids: list[str], external_ids: list[str]) -> dict[str, str]:
    """Map the ids the worker saw to the ids the caller gave.

    vLLM 0.32 appends ``-<8 hex>`` to the caller's request id inside the engine; older versions
    use the id as given.
    """
    externals = set(external_ids)
    mapping = {}
    for internal in internal_ids:
        external = internal if internal in externals else internal.rpartition("-")[0]
        if external not in externals:
            raise RuntimeError(
                f"captured request {internal!r} matches none of this call's requests"
            )
        if external in mapping.values():
            raise RuntimeError(f"request {external!r} was captured under two engine ids")
        mapping[internal] = external
    return mapping


class _Generation:
    """``llm.generate`` on a thread; its outputs, or its error re-raised by ``wait()``.

    ``as_one_call``: every request enters the engine before its first step.
    """

    def __init__(self, llm: Any, prompts: list, params: list, as_one_call: bool = False) -> None:
        self._llm = llm
        self.outputs: list = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run,
            args=(llm, prompts, params, as_one_call),
            name="draftflow-generate",
            daemon=True,
        )
        self._thread.start()

    def _run(self, llm: Any, prompts: list, params: list, as_one_call: bool) -> None:
        try:
            if as_one_call:
                self.outputs = generate_as_one_call(llm, prompts, params)
            else:
                self.outputs = llm.generate(prompts, params, use_tqdm=False)
        except BaseException as error:
            self._error = error

    def alive(self) -> bool:
        return self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise engine_failure(self._llm, error) from error


class HooksBackend:
    name = "hooks"

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        layer_ids: list[int],
        settings: CaptureEngineSettings,
    ) -> None:
        self.vllm_version = installed_vllm_version()
        check_hooks_version(self.vllm_version)
        self.layer_ids = list(layer_ids)
        self._tmp = tempfile.TemporaryDirectory(
            prefix="draftflow-capture-", dir=capture_tmp_root(), ignore_cleanup_errors=True
        )
        env = capture_engine_env(settings, settings.model_runner)
        self.llm = start_engine(
            {"worker_extension_cls": EXTENSION, **capture_engine_kwargs(model_dir, settings)}, env
        )
        self.hold_first_step = hold_first_step(self.llm, env, settings.deterministic)
        replies = self.llm.collective_rpc(
            "draftflow_capture_setup", args=(self.layer_ids, self._tmp.name, settings.store_dtype)
        )
        log.info("hooks installed: %s", replies)
        self.setup = next(r for r in replies if r.get("active"))
        self.store_dtype = settings.store_dtype
        self.last_stats: dict = {}
        self._calls = 0

    def capture(self, token_ids: list[list[int]]) -> list[torch.Tensor | Quantized]:
        return list(self.capture_iter(token_ids))

    def capture_iter(self, token_ids: list[list[int]]) -> Iterator[torch.Tensor | Quantized]:
        """States of each prompt in input order, each as soon as the worker has filed it.

        The engine runs the whole call in a thread; a prompt's states are yielded when its file
        appears, so the caller stores them while the engine works on the rest. With an fp8
        ``store_dtype`` they come quantized by the worker (``Quantized``).
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._calls += 1
        keys = [f"c{self._calls:06d}-{i:06d}" for i in range(len(token_ids))]
        self.llm.collective_rpc("draftflow_capture_reset")
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in ids]) for ids in token_ids]
        params = [
            SamplingParams(
                max_tokens=1, temperature=0.0, detokenize=False, extra_args={FILE_KEY: key}
            )
            for key in keys
        ]
        run = _Generation(self.llm, prompts, params, as_one_call=self.hold_first_step)
        directory = Path(self._tmp.name)
        checked = False
        try:
            for key, ids in zip(keys, token_ids, strict=True):
                path = directory / f"{key}.bin"
                while not path.exists():
                    if run.alive():
                        time.sleep(POLL_S)
                        continue
                    if not checked:  # the engine is done: wait for the worker's last filings
                        run.wait()
                        self._check_call(run.outputs, token_ids)
                        checked = True
                    if not path.exists():
                        raise RuntimeError(f"the worker filed no states for prompt {key}")
                layout = RequestFile(
                    len(ids), len(self.layer_ids), int(self.setup["hidden_size"]), self.store_dtype
                )
                yield map_request_file(str(path), layout)
            if not checked:
                run.wait()
                self._check_call(run.outputs, token_ids)
        finally:
            run.wait()

    def _check_call(self, outputs: list, token_ids: list[list[int]]) -> None:
        """After the engine finished: every request complete, one per prompt, right length."""
        replies = [r for r in self.llm.collective_rpc("draftflow_capture_fetch") if r]
        if len(replies) != 1:
            raise RuntimeError(f"expected one capturing worker (tp rank 0), got {len(replies)}")
        requests, self.last_stats = replies[0]["requests"], replies[0]["stats"]
        incomplete = {rid: r["missing"] for rid, r in requests.items() if r["missing"]}
        if incomplete:
            raise RuntimeError(f"capture incomplete (request id: missing positions) {incomplete}")
        mapping = match_request_ids(list(requests), [output.request_id for output in outputs])
        by_external = {mapping[internal]: r for internal, r in requests.items()}
        for output, ids in zip(outputs, token_ids, strict=True):
            request = by_external.get(output.request_id)
            if request is None:
                raise RuntimeError(f"request {output.request_id} produced no captured states")
            if request["length"] != len(ids):
                raise RuntimeError(
                    f"request {output.request_id}: captured {request['length']} positions for "
                    f"a prompt of {len(ids)} tokens"
                )

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            try:
                llm.collective_rpc("draftflow_capture_close")
            except Exception as error:  # a dead engine: the call that killed it raised already
                log.warning("the capture workers could not be closed: %s", error)
            finally:
                shutdown_engine(llm)
        self._tmp.cleanup()
