"""Layer 5: runtime - paged KV cache, sequences, continuous-batching scheduler, engine."""
