"""The vLLM adapter (docs/adapters/vllm.md)."""
