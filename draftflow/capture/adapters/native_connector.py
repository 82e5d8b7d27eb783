"""vLLM >= 0.24 on the CPU build (written against 0.32): ``ExampleHiddenStatesConnector`` that also runs on the CPU.

The stock connector copies the states out of its KV-cache slot through a CUDA stream into pinned
memory and writes the file on a thread; on the CPU ``pin_memory=True`` raises ("requires a CUDA or
other accelerator backend"). This subclass does the same work synchronously on whatever device the
cache lives on. It is loaded by name through ``kv_connector_module_path``.
"""

from __future__ import annotations

import fcntl
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for the CUDA event the base class polls: the write finished synchronously."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class SyncHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (offsets[None, :] + block_ids[:, None] * self._block_size).flatten()
        num_tokens = pending.token_ids.shape[0]
        hidden_states = extract_from_kv_cache(
            self._kv_cache, slot_mapping.to(self._kv_cache.device), num_tokens
        ).to("cpu", copy=True)
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            save_file(
                {"hidden_states": hidden_states, "token_ids": pending.token_ids.clone()},
                pending.filename,
            )
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the reader's wait
        self._req_copy_events[pending.req_id] = _Done()
