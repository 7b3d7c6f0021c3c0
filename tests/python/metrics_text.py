"""Parses Prometheus text exposition from stdin with the parser of
Prometheus's own Python client, and prints its metric families as JSON:
[{"name", "type", "samples": [{"name", "labels", "value"}]}]. The gateway
metrics test reads berth's /metrics through it, as a scraper would.

    python3 tests/python/metrics_text.py < metrics.txt
"""

import json
import sys

from prometheus_client.parser import text_string_to_metric_families

families = [
    {
        "name": family.name,
        "type": family.type,
        "samples": [
            {"name": s.name, "labels": s.labels, "value": s.value} for s in family.samples
        ],
    }
    for family in text_string_to_metric_families(sys.stdin.read())
]
json.dump(families, sys.stdout)
