"""Generators for the deployment assets in deploy/ (run `python -m scripts.render_manifests`)."""
