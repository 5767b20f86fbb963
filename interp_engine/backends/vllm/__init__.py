"""The vLLM backends. Only this package imports vllm, and only when a vLLM handle loads."""
