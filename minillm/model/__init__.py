"""Layer 3: the model - config, weight readers (GGUF, safetensors), the transformer."""
