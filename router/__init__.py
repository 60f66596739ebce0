"""Request path: OpenAI protocol, tokenization, routing policies and the Ray Serve ingress."""
