"""Request path: vLLM's OpenAI frontend in the ingress, the routed engine client, routing policies."""
