"""Observability: engine-side step records, front-end counters and histograms,
Prometheus exposition, log lines and the dashboard's data."""
