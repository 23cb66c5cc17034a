"""Webhook servers built on HTTP server libraries, for `python -m bench.http_floods
--candidate NAME` (issue 42): each serves what `driver/webhook/server.py` serves (TLS,
`POST /validate-resource-claim-parameters`, the health paths) with the bounds its
library offers, and nothing of ours around it. `common` holds what they share: the
endpoint's behaviour, the bounds' values, the TLS context, the listening socket.

    PYTHONPATH=<repo>:<candidates dir> .venv/bin/python -m bench.http_candidates.NAME \\
        --tls-cert-file CERT --tls-private-key-file KEY

prints `port N` once listening on 127.0.0.1 (`bench/candidates-install.sh` installs the
libraries other than aiohttp into the candidates directory).
"""

from __future__ import annotations

#: --candidate NAME -> module of this package
CANDIDATES = {
    "uvicorn-httptools": "uvicorn_httptools",
    "uvicorn-h11": "uvicorn_h11",
    "hypercorn-h11": "hypercorn_h11",
    "aiohttp": "aiohttp_server",
}
#: the distributions each candidate runs on, for the results file
LIBRARIES = {
    "uvicorn-httptools": ("uvicorn", "httptools"),
    "uvicorn-h11": ("uvicorn", "h11"),
    "hypercorn-h11": ("hypercorn", "h11"),
    "aiohttp": ("aiohttp",),
}
