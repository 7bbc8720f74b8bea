"""Metric families as the contract tests compare them, on both sides of the judge.

Imported by the tests (the project's virtualenv) and by ``vllm_judge.py`` (``.venv-vllm``, from
this folder), so it needs nothing but the standard library: it reads the ``name``, ``type`` and
``samples`` (each a ``name`` and ``labels``) of prometheus_client's metric families, whichever
installation built them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def summarize(families: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """Every ``vllm:`` family: its type, label names (without ``le``), histogram bucket bounds
    (without +Inf) and the sample names it exposes. prometheus_client adds a ``_created``
    series beside every counter and histogram (a sample in a registry's family, a gauge family
    of its own once written and parsed): an exposition artifact, not vLLM's contract."""
    out: dict[str, dict[str, Any]] = {}
    for family in families:
        if not family.name.startswith("vllm:") or family.name.endswith("_created"):
            continue
        labels: set[str] = set()
        buckets: set[float] = set()
        samples: set[str] = set()
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            samples.add(sample.name)
            labels.update(k for k in sample.labels if k != "le")
            if sample.name.endswith("_bucket") and sample.labels.get("le") != "+Inf":
                buckets.add(float(sample.labels["le"]))
        out[family.name] = {
            "type": family.type,
            "labels": sorted(labels),
            "buckets": sorted(buckets),
            "samples": sorted(samples),
        }
    return out
