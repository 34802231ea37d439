"""Integrations with outside systems, one package each, installed as
``parallel_backend.plugins``. Each imports only the core's public names and its
own dependency, and is importable only when that dependency is installed."""
