"""``dask-services status``: the status tables of a running cluster, from a terminal.

The same rows as ``dask_services.status(client, table=...)`` (``_status.py``), for a
cluster the caller reaches by its scheduler's address, a scheduler file, or the dask
config's ``scheduler-address`` (``DASK_SCHEDULER_ADDRESS``), as ``dask worker`` finds its
scheduler.  Like ``status()``, it first installs dask_services' plugins on a cluster that
has not got them yet (the tables are theirs: nothing else changes); then it only reads:
the rows are the scheduler's, as of its last heartbeats (the ``replicas`` table's call
figures as of a question to the workers holding replicas, as ``status()`` asks them).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

DEFAULT_TIMEOUT = "10s"
# the options `dask worker` and `dask scheduler` take for TLS, and what each names
TLS_OPTIONS = {"--tls-ca-file": "the CA certificate file",
               "--tls-cert": "the client's certificate file",
               "--tls-key": "the client's private key file (if not in --tls-cert)"}


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """The ``status`` subcommand's parser, on ``sub`` (the CLI's subparsers)."""
    parser = sub.add_parser(
        "status", help="the service runs (or replicas) of a running cluster",
        description="Print a status table of a running cluster's services: 'runs' (one "
                    "row per live or recently ended service run) or 'replicas' (one row "
                    "per replica of every deployed service).")
    parser.add_argument("address", nargs="?", default=None,
                        help="the scheduler's address, e.g. tcp://10.0.0.1:8786 (default: "
                             "--scheduler-file, else the dask config's scheduler-address, "
                             "i.e. DASK_SCHEDULER_ADDRESS)")
    parser.add_argument("--scheduler-file", default=None,
                        help="a scheduler file, as written by `dask scheduler "
                             "--scheduler-file`")
    parser.add_argument("--table", default="runs",
                        help="the table: 'runs' (default) or 'replicas'")
    parser.add_argument("--columns", default="",
                        help="comma-separated columns to print (default: all)")
    parser.add_argument("--json", action="store_true",
                        help="print the rows as a JSON list of objects")
    parser.add_argument("--timeout", default=DEFAULT_TIMEOUT,
                        help=f"how long to try to reach the scheduler (default "
                             f"{DEFAULT_TIMEOUT})")
    for option, what in TLS_OPTIONS.items():
        parser.add_argument(option, default=None,
                            help=f"{what}, for a scheduler at a tls:// address (default: "
                                 "the dask config's distributed.comm.tls settings)")
    parser.set_defaults(func=status_command)
    return parser


def bad_argument(args: argparse.Namespace) -> str | None:
    """What is wrong with ``status``'s arguments before connecting (None: nothing)."""
    from dask.utils import parse_timedelta

    if args.address and args.scheduler_file:
        return "give the scheduler's address or --scheduler-file, not both"
    try:
        if parse_timedelta(args.timeout) <= 0:
            raise ValueError
    except (ValueError, TypeError, KeyError):
        return f"--timeout takes a duration such as 10s or 2min; got {args.timeout!r}"
    if not args.table:
        return "--table takes a table's name, e.g. runs or replicas"
    import os

    for option in TLS_OPTIONS:
        path = getattr(args, option[2:].replace("-", "_"))
        if path is not None and not os.path.isfile(path):
            return f"{option}: no such file {path!r}"
    if scheduler_address(args) is None and not args.scheduler_file:
        return ("no scheduler to ask: give its address (dask-services status "
                "tcp://10.0.0.1:8786), --scheduler-file, or set DASK_SCHEDULER_ADDRESS")
    return None


def scheduler_address(args: argparse.Namespace) -> str | None:
    """The address given, else the dask config's ``scheduler-address`` (None: neither)."""
    import dask

    return args.address or dask.config.get("scheduler-address", None) or None


def status_command(args: argparse.Namespace) -> int:
    """Print the table; 0 once printed, 1 if the scheduler could not be reached or
    asked within ``--timeout``, 2 for a table or column it does not have."""
    import asyncio
    import os

    from dask.utils import parse_timedelta

    timeout = parse_timedelta(args.timeout)
    where = args.scheduler_file or scheduler_address(args)
    if args.scheduler_file and not os.path.exists(args.scheduler_file):
        print(f"dask-services status: no scheduler file at {args.scheduler_file} (a "
              "scheduler started with `dask scheduler --scheduler-file` writes it)",
              file=sys.stderr)
        return 1
    security = _security(args)
    address = _address_to_reach(args)
    if address.startswith("tls://") and security.get_connection_args(
            "client").get("ssl_context") is None:
        print(f"dask-services status: the scheduler at {address} speaks TLS and no "
              "certificates were given: pass --tls-ca-file, --tls-cert and --tls-key (a "
              "client's of that cluster), or set them in the dask config "
              "(distributed.comm.tls.ca-file, .client.cert, .client.key)", file=sys.stderr)
        return 1
    try:
        frame = asyncio.run(_ask(args, timeout, security))
    except KeyError as exc:
        print(f"dask-services status: {exc.args[0] if exc.args else exc}",
              file=sys.stderr)
        return 2
    except _NoAnswer as exc:
        print(f"dask-services status: the scheduler at {where} could not give its "
              f"{args.table!r} table: {exc} (is dask_services installed in the "
              "scheduler's environment?)", file=sys.stderr)
        return 1
    except Exception as exc:  # not a scheduler, or none answering, within the timeout
        if isinstance(exc, TimeoutError):
            reason = f"no answer within {args.timeout}"
        elif isinstance(exc, OSError):
            reason = f"{type(exc).__name__}: {exc}"
        else:  # e.g. an HTTP server's reply read as a dask message
            reason = (f"it answered, but not as a dask scheduler does "
                      f"({type(exc).__name__}: {exc})")
        print(f"dask-services status: could not reach the scheduler at {where} within "
              f"{args.timeout}: {reason}", file=sys.stderr)
        return 1
    columns = [c.strip() for c in args.columns.split(",") if c.strip()]
    unknown = [c for c in columns if c not in frame.columns]
    if unknown:
        print(f"dask-services status: the {args.table!r} table has no column "
              f"{', '.join(map(repr, unknown))}; its columns: {', '.join(frame.columns)}",
              file=sys.stderr)
        return 2
    if columns:
        frame = frame[columns]
    if args.json:
        # strict JSON: a missing figure (NaN: a replica without calls yet) is null
        rows = frame.astype(object).where(frame.notna(), None).to_dict(orient="records")
        print(json.dumps(rows, indent=2, default=str, allow_nan=False))
    elif frame.empty:
        print(f"no rows in the {args.table!r} table (nothing has run or been deployed "
              "yet, or it has ended longer ago than the table keeps)")
    else:
        print(frame.to_string(index=False, max_colwidth=60))
    return 0


class _NoAnswer(Exception):
    """The scheduler was reached but could not give the table."""


def _security(args: argparse.Namespace) -> Any:
    """A ``distributed.Security`` of the TLS files given (each option not given: the dask
    config's, as ``Security()`` reads it)."""
    from distributed import Security

    given = {"tls_ca_file": args.tls_ca_file, "tls_client_cert": args.tls_cert,
             "tls_client_key": args.tls_key}
    return Security(**{k: v for k, v in given.items() if v is not None})


def _address_to_reach(args: argparse.Namespace) -> str:
    """The scheduler's address: given, from the scheduler file ("" if it has none), or
    the config's."""
    if args.scheduler_file:
        try:
            with open(args.scheduler_file) as f:
                return str(json.load(f).get("address", ""))
        except (OSError, ValueError, AttributeError):
            return ""  # the client says what is wrong with it
    return scheduler_address(args) or ""


async def _ask(args: argparse.Namespace, timeout: float, security: Any = None) -> Any:
    """The table's rows from the scheduler, on an asynchronous client.  Reaching the
    scheduler and asking it are each bounded by ``timeout``: distributed's own connect
    timeout does not bound a peer that accepts the connection and never answers."""
    import asyncio

    from distributed import Client

    from dask_services._status import status
    from dask_services.client import install_async

    client = Client(address=None if args.scheduler_file else scheduler_address(args),
                    scheduler_file=args.scheduler_file, timeout=timeout, security=security,
                    asynchronous=True, set_as_default=False)
    try:
        async with asyncio.timeout(timeout):
            await client
    except BaseException:
        await _close(client, min(timeout, 1.0))
        raise
    try:
        async with asyncio.timeout(timeout):
            await install_async(client)
            return await status(client, table=args.table)
    except KeyError:
        raise
    except TimeoutError as exc:
        raise _NoAnswer(f"no answer within {args.timeout}") from exc
    except Exception as exc:
        raise _NoAnswer(f"{type(exc).__name__}: {exc}") from exc
    finally:
        await _close(client, min(timeout, 1.0))


async def _close(client: Any, timeout: float) -> None:
    """Close ``client``, for at most ``timeout``: a scheduler that never answered, or
    stopped answering, would keep the command waiting."""
    import asyncio

    try:
        async with asyncio.timeout(timeout):
            await client.close()
    except Exception:  # a scheduler that stopped answering: nothing to close cleanly
        pass
