"""The webhook on uvicorn with its h11 protocol: `uvicorn_httptools` says which bounds
uvicorn has (here `h11_max_incomplete_event_size=8192` applies: a head over 8 KiB is
refused with 400) and which it lacks."""

from __future__ import annotations

from bench.http_candidates.uvicorn_httptools import serve

if __name__ == "__main__":
    serve("h11")
