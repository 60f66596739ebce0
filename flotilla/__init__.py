"""Flotilla: a Ray-based multi-node LLM serving cluster.

``flotilla.cluster`` owns lifecycles (placement, groups, leaders, the coordinator, EPLB), and
``flotilla.router`` owns the request path (vLLM's frontend, routing, the ingress). This package
is the composition root, the only code that imports both: the serve config that nests their
settings, the launcher that wires them together, and the CLI.
"""
