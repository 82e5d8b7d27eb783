"""Draft vocabulary and EAGLE-3 draft training around speculators (docs/training.md)."""
