"""Layer 4: generation - tokenizer, chat template, sampling, the autoregressive loop."""
