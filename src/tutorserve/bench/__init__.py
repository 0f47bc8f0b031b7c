"""Measurement: education workloads, serving and offline benchmarks with peers side by side,
goodput under latency SLOs, rooflines, and the reports and plots they write."""
