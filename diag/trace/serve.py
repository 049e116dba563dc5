"""XProf's web UI over a run folder, reachable from this machine only (`diag trace --serve`).

The `xprof` command (2.24) binds its HTTP server on a wildcard address and a gRPC worker
service on 0.0.0.0:50051, with no option to narrow either: anyone who can reach the machine
can read the traces (and the program text in them). diag builds the same web app from the
package's own parts (`xprof.server.make_wsgi_app` over the profile plugin) and serves it with
cheroot bound to 127.0.0.1 only; it starts no gRPC service (that one distributes conversion
over several hosts, which one run folder does not need). From another machine, forward the
port (`ssh -L 8791:127.0.0.1:8791 host`).

These xprof internals are not a stable API: any failure to assemble the app is a one-line
`diag:` error naming the xprof version and the fallback (`xprof --logdir RUN`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from diag.errors import UsageError

__all__ = ["serve", "HOST"]

HOST = "127.0.0.1"


def _quiet_xprof() -> None:
    """Warnings only from XProf's logger (it logs every request and import at INFO on
    stderr); set before xprof is imported, which adds its own INFO handler only when the
    logger has none."""
    logger = logging.getLogger("tensorboard.plugins.profile")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setLevel(logging.WARNING)
        logger.addHandler(handler)
        logger.propagate = False


def _app(logdir: Path):
    """XProf's WSGI app over `logdir`, as `xprof.server._launch_server` builds it."""
    _quiet_xprof()
    from xprof import profile_plugin_loader, server
    from xprof.standalone import base_plugin, plugin_event_multiplexer

    context = base_plugin.TBContext(
        str(logdir),
        plugin_event_multiplexer.DataProvider(str(logdir)),
        base_plugin.TBContext.Flags(False),
    )
    context.hide_capture_profile_button = True
    context.enable_tab_name_label = False
    context.src_prefix = None
    plugin = profile_plugin_loader.ProfilePluginLoader().load(context)
    return server.make_wsgi_app(plugin)


def serve(
    run_dir: str | Path, port: int = 8791, on_ready: Callable[[str], None] | None = None
) -> None:
    """Serve XProf over a run folder on 127.0.0.1 until interrupted.

    Args:
      run_dir: a traced run folder (an XProf logdir).
      port: the TCP port (0: any free one).
      on_ready: called with the URL once the socket listens.

    Raises:
      UsageError: xprof is not installed or its internals changed, or the port is taken.
      KeyboardInterrupt: Ctrl-C (or SIGTERM through diag's handler) stops the server.
    """
    try:
        from cheroot import wsgi
    except ImportError as e:
        raise UsageError(
            f"--serve needs xprof ({e}); install it with pip install 'diag[trace]'"
        ) from None
    # Listen first: a taken port is said before xprof spends seconds loading.
    server = wsgi.Server((HOST, port), None)
    try:
        server.prepare()
    except OSError as e:
        raise UsageError(
            f"cannot listen on {HOST}:{port}: {e.strerror or e}; pass another --port"
        ) from None
    try:
        server.wsgi_app = _app(Path(run_dir).resolve())
    except ImportError as e:
        server.stop()
        raise UsageError(
            f"--serve needs xprof ({e}); install it with pip install 'diag[trace]'"
        ) from None
    except Exception as e:  # xprof's internals moved: say so, and how to go on
        server.stop()
        raise UsageError(
            f"cannot start XProf's web app ({type(e).__name__}: {e}); open the "
            f"folder with `xprof --logdir {run_dir}` instead (it listens on every "
            f"interface)"
        ) from None
    host, bound = server.bind_addr[:2]
    if on_ready:
        on_ready(f"http://{host}:{bound}/")
    try:
        server.serve()
    finally:
        server.stop()
