"""Who can reach the app: it listens on 127.0.0.1 (the repository's .streamlit/config.toml). Started with another
`--server.address` (0.0.0.0, an interface's address), anyone who reaches that address and port can start jobs,
delete runs and write models (docs/app.md, "Who can reach the app"): the app says so in its page and in its log.

    said = exposure_warning(streamlit.config.get_option("server.address"))   # None on this machine only
"""

from __future__ import annotations

import ipaddress
import sys

_logged: set[str] = set()  # the warnings this server process has printed (once each)


def exposure_warning(address) -> str | None:
    """What the app says when its server listens beyond this machine: an address that is not a loopback one (unset
    or empty: streamlit listens on every interface). None for 127.0.0.1, ::1, localhost and the rest of 127/8."""
    text = str(address or "").strip().strip("[]")
    if text.lower() == "localhost":
        return None
    try:
        if ipaddress.ip_address(text).is_loopback:
            return None
    except ValueError:
        pass  # (a host name, or nothing: not known to be this machine only)
    where = f"on {text}" if text else "on every interface (no server.address is set)"
    return (f"This app listens {where}: anyone who can reach that address can start and stop jobs, delete runs and "
            "write models here; it has no login. Prefer 127.0.0.1 with an SSH tunnel (docs/app.md, \"Who can reach "
            "the app\").")


def log_once(warning: str, stream=None) -> None:
    """The warning on stderr (the server's log), once per process: the script runs again on every interaction."""
    if warning in _logged:
        return
    _logged.add(warning)
    print(f"warning: {warning}", file=stream or sys.stderr, flush=True)
