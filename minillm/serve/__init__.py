"""Layer 6: serving - OpenAI-compatible HTTP server, metrics, load generator."""
