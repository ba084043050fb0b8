"""Models: checkpoints (GGUF, safetensors), tokenizers and chat templates, the catalog, and the torch forward passes."""
