"""Helpers for tests that drive a real embps-server process over gRPC with Python's grpcio: a
server to drive (Server, started by tests/lib/embps_servers.py), the generated stubs, and the
optimizers' reference math.

Stubs are generated from proto/ into a temporary folder at import time (Debian's
python3-grpc-tools), so the tests always speak the committed contract; the folder is removed
when the process exits.
"""
import atexit
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "lib"))
import embps_servers as servers  # noqa: E402
from embps_servers import server_binary  # noqa: E402,F401

_GEN = tempfile.mkdtemp(prefix="embps-stubs-")
atexit.register(shutil.rmtree, _GEN, ignore_errors=True)


def _generate_stubs():
    from grpc_tools import protoc
    # health.proto is copied to another path first: generated at grpc/health/v1/ its module
    # would shadow the grpc package itself. Its proto package (and so the method path
    # /grpc.health.v1.Health/Check) stays the same.
    hdir = os.path.join(_GEN, "src", "embps_health")
    os.makedirs(hdir)
    with open(os.path.join(ROOT, "proto/grpc/health/v1/health.proto")) as f, \
            open(os.path.join(hdir, "health.proto"), "w") as g:
        g.write(f.read())
    jobs = [(os.path.join(ROOT, "proto"), "embps/v1/embps.proto"),
            (os.path.join(_GEN, "src"), "embps_health/health.proto")]
    for inc, p in jobs:
        rc = protoc.main(["protoc", "-I" + inc, "--python_out=" + _GEN,
                          "--grpc_python_out=" + _GEN, p])
        if rc != 0:
            raise RuntimeError("protoc failed for " + p)
    for d in ["embps", "embps/v1", "embps_health"]:
        open(os.path.join(_GEN, d, "__init__.py"), "a").close()


import grpc  # noqa: E402
import numpy as np  # noqa: E402

_generate_stubs()
sys.path.insert(0, _GEN)

from embps.v1 import embps_pb2, embps_pb2_grpc  # noqa: E402,F401
from embps_health import health_pb2, health_pb2_grpc  # noqa: E402,F401


class Server(servers.Server):
    """An embps-server alone on a free loopback port, ready (listening, group ready) when
    constructed; close() stops it with SIGTERM and returns its exit code (tests/lib/
    embps_servers.py). wait_serving also asks its gRPC health check."""

    def wait_serving(self, timeout=60):
        """Waits (bounded) until the health check says SERVING: a rank answers calls other than
        health with UNAVAILABLE while its group (even of one) forms, which takes longer on a
        loaded machine or under a sanitizer."""
        deadline = time.time() + timeout
        with channel(self.address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                try:
                    r = stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.time() > deadline or not self.alive():
                    raise RuntimeError("server not SERVING within %d s:\n%s" % (timeout,
                                                                                self.log_text()))
                time.sleep(0.05)


def channel(address):
    opts = [("grpc.max_receive_message_length", 512 << 20),
            ("grpc.max_send_message_length", 512 << 20)]
    return grpc.insecure_channel(address, options=opts)


def optimizer_update(kind, w, g, state, lr, eps, decay, init_acc, b1, b2, step):
    """One row's fused update as kernels/embps_kernels.h defines it, in f32 numpy.

    w and g are the row's weights and (summed, weight-decayed) gradient; state is the row's
    optimizer state from the previous call, or None before the first. Returns (w, state).
    Shared by the interop and group tests' references so that both check the same math."""
    if kind == "sgd":
        return w - lr * g, state
    if kind == "adagrad":
        a = (state if state is not None else np.full_like(w, init_acc)) * decay + g * g
        return w - lr * g / (np.sqrt(a) + eps), a
    if kind == "rowwise_adagrad":
        a = np.float32((state if state is not None else init_acc) * decay + np.float32(np.mean(g * g)))
        return w - lr * g / (np.sqrt(a) + eps), a
    m, v = state if state is not None else (np.zeros_like(w), np.zeros_like(w))
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    mh = m / (1 - b1 ** step)
    vh = v / (1 - b2 ** step)
    return w - lr * mh / (np.sqrt(vh) + eps), (m, v)
