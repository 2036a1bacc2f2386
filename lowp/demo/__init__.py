"""The built-in demo: a small character-level language model trained on Python's own standard
library sources, to compare fp32 training with bf16 weights under each update mode."""
