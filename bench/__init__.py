"""Benchmarks. Each writes JSON and markdown under bench/results/ and a section of docs/benchmarks.md."""
