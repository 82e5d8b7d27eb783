"""transformers backend: ``output_hidden_states``, the numerical reference and the vLLM-free fallback.

HF ``hidden_states[k]`` (k < L) is the residual stream entering layer k: the aux ids map directly.
In transformers 5.x ``hidden_states[L]`` is taken *after* the final norm, so the final pre-norm
state (id L) comes from a pre-hook on the decoder's ``norm``.
"""

from __future__ import annotations

import os

import torch

from draftflow.capture.backends import EngineSettings

HF_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFBackend:
    name = "hf"
    vllm_version = None

    def __init__(
        self, model_dir: str | os.PathLike[str], layer_ids: list[int], settings: EngineSettings
    ) -> None:
        from transformers import AutoModelForCausalLM

        if settings.hf_dtype not in HF_DTYPES:
            raise ValueError(f"hf dtype {settings.hf_dtype!r}: allowed are {', '.join(HF_DTYPES)}")
        self.layer_ids = list(layer_ids)
        self.device = torch.device(settings.device)
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir),
            dtype=HF_DTYPES[settings.hf_dtype],
            trust_remote_code=settings.trust_remote_code,
        )
        self.decoder = model.get_decoder().to(self.device).eval()
        del model  # the LM head is not needed
        norm = getattr(self.decoder, "norm", None)
        if not isinstance(norm, torch.nn.Module):
            raise RuntimeError(
                f"{type(self.decoder).__qualname__} has no final 'norm' module: the hf backend "
                "cannot take the final pre-norm state of this architecture"
            )
        self.num_layers = len(self.decoder.layers)
        if self.layer_ids[-1] != self.num_layers:
            raise ValueError(
                f"layer ids {self.layer_ids} must end with the layer count {self.num_layers}"
            )
        self._pre_norm: torch.Tensor | None = None
        norm.register_forward_pre_hook(self._keep_pre_norm)

    def _keep_pre_norm(self, module: torch.nn.Module, args: tuple) -> None:
        self._pre_norm = args[0]

    @torch.inference_mode()
    def capture(self, token_ids: list[list[int]]) -> list[torch.Tensor]:
        results = []
        for ids in token_ids:  # one at a time: no padding, exact reference
            input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
            output = self.decoder(input_ids=input_ids, output_hidden_states=True, use_cache=False)
            hidden = output.hidden_states
            layers = [hidden[i][0] for i in self.layer_ids[:-1]] + [self._pre_norm[0]]
            results.append(torch.stack(layers, dim=1).cpu())
            self._pre_norm = None
        return results

    def close(self) -> None:
        self.decoder = None
