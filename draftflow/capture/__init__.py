"""draftflow.capture: the target's hidden states for EAGLE-3 training (the extract stage).

- ``store``: the capture store (safetensors chunks + index + manifest), resumable;
- ``layers``: which layer ids to capture, from the target's config;
- ``backends``: hooks (vLLM worker extension), native (vLLM's extractor), hf (transformers);
- ``worker_extension`` and ``adapters``: the only code that touches vLLM internals;
- ``verify``: per-layer cosine checks against transformers;
- ``extract``: one shard from samples to a verified store (called by scripts/extract.py).

docs/capture.md describes them.
"""
