"""grpc-timeout as a raw HTTP/2 client sends it (Debian's python3-h2, not grpcio, which only ever
sends well-formed values), against a real embps-server: every malformed value is refused with
INVALID_ARGUMENT and a message naming the header and the form it needs, and the table is
unchanged; a timeout already past when the request is complete is DEADLINE_EXCEEDED; a generous
one in each unit is served, as is a grpcio call with a deadline (grpcio writes its own
grpc-timeout). Deadlines that bound a batch in a group: tests/group/test_group_deadline.py.
"""
import os
import socket
import struct
import sys
import unittest
import urllib.parse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import embps_testlib as lib  # noqa: E402
import grpc  # noqa: E402
import numpy as np  # noqa: E402

try:
    import h2.config
    import h2.connection
    import h2.events
except ImportError:  # pragma: no cover
    print("skipped: python3-h2 is not installed (deploy/packages.sh installs it)")
    sys.exit(77)

pb = lib.embps_pb2
WIDTH = 4
MALFORMED = ["bogus", "-1m", "123456789S", "1x", "10", "m", "1.5S", "+1S", "0x1S"]


def raw_call(address, path, message, headers, timeout=10.0):
    """One gRPC call over a fresh HTTP/2 connection: returns (grpc-status, grpc-message, body).
    Every read is bounded by the socket timeout; the loop ends at the stream's end."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    sid = conn.get_next_available_stream_id()
    conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":path", path),
                            (":authority", address), ("content-type", "application/grpc"),
                            ("te", "trailers")] + headers)
    conn.send_data(sid, b"\0" + struct.pack(">I", len(message)) + message, end_stream=True)
    sock.sendall(conn.data_to_send())
    status, msg, body, done = None, "", b"", False
    try:
        for _ in range(10000):
            data = sock.recv(65536)
            if not data:
                break
            for ev in conn.receive_data(data):
                if isinstance(ev, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                    for k, v in ev.headers:
                        k, v = k.decode(), v.decode()
                        if k == "grpc-status":
                            status = int(v)
                        elif k == "grpc-message":
                            msg = urllib.parse.unquote(v)
                elif isinstance(ev, h2.events.DataReceived):
                    body += ev.data
                    conn.acknowledge_received_data(ev.flow_controlled_length, sid)
                elif isinstance(ev, (h2.events.StreamEnded, h2.events.StreamReset)):
                    done = True
            sock.sendall(conn.data_to_send())
            if done:
                break
    finally:
        sock.close()
    return status, msg, body


class GrpcTimeoutTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = lib.Server()
        cls.server.wait_serving()
        cls.channel = lib.channel(cls.server.address)
        cls.stub = lib.embps_pb2_grpc.EmbeddingServiceStub(cls.channel)
        cls.stub.CreateTable(pb.CreateTableRequest(spec=pb.TableSpec(
            name="t", rows=64, emb_width=WIDTH, optimizer=pb.OptimizerConfig(
                kind=pb.OPTIMIZER_SGD, lr=0.5))), timeout=30)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        assert cls.server.close() == 0, cls.server.log_text()

    def rows(self):
        r = self.stub.Lookup(pb.LookupRequest(table="t", tokens=np.arange(64, dtype="<i8")
                                              .tobytes()), timeout=30)
        return np.frombuffer(r.rows, "<f4").copy()

    def push(self, timeout_header):
        tok = np.array([1, 2, 3, 4], "<i8")
        req = pb.PushGradientsRequest(table="t", tokens=tok.tobytes(), dtype=pb.DTYPE_F32,
                                      gradients=np.ones((4, WIDTH), "<f4").tobytes())
        headers = [("grpc-timeout", timeout_header)] if timeout_header is not None else []
        return raw_call(self.server.address, "/embps.v1.EmbeddingService/PushGradients",
                        req.SerializeToString(), headers)

    def test_malformed_values_are_refused_and_change_nothing(self):
        before = self.rows()
        for v in MALFORMED:
            with self.subTest(value=v):
                status, msg, _ = self.push(v)
                self.assertEqual(status, grpc.StatusCode.INVALID_ARGUMENT.value[0], msg)
                self.assertIn("malformed grpc-timeout header", msg)
                self.assertIn("1 to 8 digits and a unit H, M, S, m, u or n", msg)
        np.testing.assert_array_equal(self.rows(), before)

    def test_a_past_deadline_is_deadline_exceeded_and_changes_nothing(self):
        before = self.rows()
        status, msg, _ = self.push("1n")  # also the unit n: a unit not read would be refused
        self.assertEqual(status, grpc.StatusCode.DEADLINE_EXCEEDED.value[0], msg)
        np.testing.assert_array_equal(self.rows(), before)

    def test_valid_values_in_every_unit_are_served(self):
        for v in ["1H", "2M", "30S", "30000m", "99999999u", "99999999S"]:
            with self.subTest(value=v):
                before = self.rows()
                status, msg, body = self.push(v)
                self.assertEqual(status, 0, msg)
                self.assertFalse(np.array_equal(self.rows(), before), "the push was not applied")

    def test_grpcio_deadlines(self):
        r = self.stub.Lookup(pb.LookupRequest(table="t", tokens=np.arange(8, dtype="<i8")
                                              .tobytes()), timeout=30)
        self.assertEqual(len(r.rows), 8 * WIDTH * 4)


if __name__ == "__main__":
    unittest.main(verbosity=2)
