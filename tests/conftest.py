"""Test-wide settings.

OMP_WAIT_POLICY=PASSIVE must be set before torch (and its OpenMP runtime) loads: spinning OpenMP threads slow
torch several-fold when the cores are shared (the CLI sets the same default).

Every test server listens on loopback; gRPC and urllib follow ``http_proxy``/``https_proxy``, so on a machine
that reaches its package registry through a proxy, loopback is exempted (subprocesses inherit this).
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

for _name in ("NO_PROXY", "no_proxy"):
    _hosts = [h for h in os.environ.get(_name, "").split(",") if h]
    os.environ[_name] = ",".join([*_hosts, *(h for h in ("127.0.0.1", "localhost") if h not in _hosts)])
