"""draftflow: train EAGLE-3 draft models for vLLM speculative decoding."""

__version__ = "0.1.0"
