"""Generation: the rollout worker and the engines it drives (built-in JAX sampler, vLLM)."""
