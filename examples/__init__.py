"""Example models and data for pulsar, made offline from installed packages (see assets.py)."""
