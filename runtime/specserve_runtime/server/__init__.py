"""The OpenAI-compatible server of the embedded engine."""
