"""Routing policies: purely computational plugins, no I/O and no hidden state.

Each policy takes plain data (request features, replica views, an index instance the caller
owns) and returns plain data. Nothing here imports an HTTP, Kubernetes or Prometheus client; an
import-linter contract keeps it that way.
"""
