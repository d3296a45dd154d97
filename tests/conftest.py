"""Test-wide settings.

OMP_WAIT_POLICY=PASSIVE must be set before torch (and its OpenMP runtime) loads: spinning OpenMP threads slow
torch several-fold when the cores are shared (the CLI sets the same default).

Every test server listens on loopback; gRPC and urllib follow ``http_proxy``/``https_proxy``, so on a machine
that reaches its package registry through a proxy, loopback is exempted (subprocesses inherit this).

A test suite started in the background by a non-interactive shell (``make test &`` in a script, as some CI runners
and ``nohup`` wrappers do) inherits SIGINT ignored, and so would every process it starts: Python then installs no
KeyboardInterrupt handler, and the tests that press Ctrl-C on a real ``fedcore simulate`` or engine caller would
wait for a run that never stops. The test process takes Python's default handler back, so its children start with
SIGINT's default action, as under a terminal.
"""

import os
import signal

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

for _name in ("NO_PROXY", "no_proxy"):
    _hosts = [h for h in os.environ.get(_name, "").split(",") if h]
    os.environ[_name] = ",".join([*_hosts, *(h for h in ("127.0.0.1", "localhost") if h not in _hosts)])

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
