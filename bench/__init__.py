"""Benchmarks: this driver side by side with the Go reference kubelet plugin.

See docs/benchmarks.md.
"""
