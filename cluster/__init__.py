"""Cluster side: placement, replica groups, vLLM engines, local Ray clusters and the CLI.

Kept free of imports: vLLM loads ``cluster.vllm_platform`` in every process.
"""
