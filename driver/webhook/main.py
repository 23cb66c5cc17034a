"""`gpu-dra-webhook`: validating admission webhook for GpuConfigs in ResourceClaims
and ResourceClaimTemplates (resource.k8s.io v1, v1beta1, v1beta2). HTTPS only."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType

from driver.observability.logs import (
    DAEMON_VERBOSITY,
    VERBOSITY_HELP,
    apply_verbosity,
    stderr_handler,
)
from driver.plugin.options.flags import (
    add_version_flag,
    document_env_and_defaults,
    non_negative_int,
    package_version,
)
from driver.plugin.options.host_inputs import driver_name_argument
from driver.webhook.server import VALIDATE_PATH, WebhookServer

log = logging.getLogger("gpu-dra-webhook")

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # messages escaped


def build_parser() -> argparse.ArgumentParser:
    """Every flag can also come from its environment variable (--tls-cert-file:
    TLS_CERT_FILE, --v: V); the command line wins."""
    parser = argparse.ArgumentParser(prog="gpu-dra-webhook", description=__doc__)
    add_version_flag(parser)
    parser.add_argument(
        "--tls-cert-file",
        default=os.environ.get("TLS_CERT_FILE"),
        required="TLS_CERT_FILE" not in os.environ,
        help="PEM certificate (chain) file",
    )
    parser.add_argument(
        "--tls-private-key-file",
        default=os.environ.get("TLS_PRIVATE_KEY_FILE"),
        required="TLS_PRIVATE_KEY_FILE" not in os.environ,
        help="PEM private key file",
    )
    parser.add_argument(
        "--port", type=int, default=os.environ.get("PORT", "443"), help="HTTPS port"
    )
    parser.add_argument(
        "--bind-address",
        default=os.environ.get("BIND_ADDRESS", ""),
        help="address to listen on, :: for IPv6; none means all IPv4 addresses",
    )
    parser.add_argument(
        "--driver-name",
        type=driver_name_argument,
        default=os.environ.get("DRIVER_NAME", "gpu.example.com"),
        help="DRA driver name whose opaque configs are validated",
    )
    parser.add_argument(
        "--log-level",
        default=os.environ.get("LOG_LEVEL") or None,
        choices=LOG_LEVELS,
        help="the level of the webhook's own loggers, instead of the one -v gives",
    )
    parser.add_argument(
        "-v",
        "--v",
        dest="verbosity",
        type=non_negative_int("-v"),
        default=os.environ.get("V", str(DAEMON_VERBOSITY)),
        metavar="N",
        help=VERBOSITY_HELP,
    )
    document_env_and_defaults(parser)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    # argparse checks the choices of command-line values only, not of env defaults.
    if args.log_level is not None and args.log_level not in LOG_LEVELS:
        parser.error(f"--log-level (or LOG_LEVEL): {args.log_level!r} is not one of {LOG_LEVELS}")
    return args


def configure_logging(args: argparse.Namespace) -> None:
    """The verbosity scale of every binary (`driver.observability.logs`); an explicit
    --log-level (LOG_LEVEL) sets the webhook's own level instead."""
    logging.basicConfig(handlers=[stderr_handler(LOG_FORMAT)])
    apply_verbosity(args.verbosity)
    if args.log_level is not None:
        logging.getLogger().setLevel(args.log_level)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args)
    try:
        server = WebhookServer(
            args.bind_address,
            args.port,
            cert_file=args.tls_cert_file,
            key_file=args.tls_private_key_file,
            driver_name=args.driver_name,
        )
    except OSError as err:  # includes ssl.SSLError: unreadable / mismatched cert or key
        print(f"gpu-dra-webhook: cannot start: {err}", file=sys.stderr)
        return 1

    def stop(signum: int, _frame: FrameType | None) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        # shutdown() waits for serve_forever(), which runs in this (the main) thread
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info(
        "gpu-dra-webhook %s serving https on port %d, POST %s, driver %s",
        package_version(),
        server.port,
        VALIDATE_PATH,
        args.driver_name,
    )
    with server:
        server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
