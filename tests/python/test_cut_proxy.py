"""tests/lib/cut_proxy.py on its own (standard library only): bytes pass unchanged, the HTTP/2
rule cuts just before the first response HEADERS of a stream opened after arming (frames split
across reads included), the byte rule after the counts asked for, cut_all and close."""
import os
import socket
import struct
import sys
import threading
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "lib"))

import cut_proxy  # noqa: E402
from cut_proxy import CutProxy  # noqa: E402


def frame(ftype, stream, payload=b"", flags=0):
    return struct.pack(">I", len(payload))[1:] + bytes((ftype, flags)) + struct.pack(
        ">I", stream) + payload


class Backend:
    """A loopback server: each connection's bytes are answered by respond(data) (bytes)."""

    def __init__(self, respond):
        self.respond = respond
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.closed = False
        threading.Thread(target=self.loop, daemon=True).start()

    def loop(self):
        while not self.closed:
            try:
                c, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self.serve, args=(c,), daemon=True).start()

    def serve(self, c):
        c.settimeout(5)
        with c:
            for _ in range(1000):
                try:
                    data = c.recv(65536)
                    if not data:
                        return
                    c.sendall(self.respond(data))
                except OSError:
                    return

    def close(self):
        self.closed = True
        self.sock.close()


def read_all(sock, limit=1 << 20):
    """Bytes until EOF or reset; (bytes, reset?)."""
    out = b""
    sock.settimeout(5)
    try:
        while len(out) < limit:
            d = sock.recv(65536)
            if not d:
                return out, False
            out += d
    except ConnectionResetError:
        return out, True
    return out, False


def es_wait(pred, timeout=5.0):
    """pred() until true or timeout seconds; its last value."""
    import time
    end = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() >= end:
            return v
        time.sleep(0.01)


class ProxyTest(unittest.TestCase):
    def test_bytes_pass_and_byte_rule(self):
        be = Backend(lambda d: d.upper())
        self.addCleanup(be.close)
        p = CutProxy("127.0.0.1", be.port)
        self.addCleanup(p.close)
        c = socket.create_connection(("127.0.0.1", p.port))
        self.addCleanup(c.close)
        c.sendall(b"hello")
        self.assertEqual(c.recv(100), b"HELLO")
        p.cut_next_reply(after_request_bytes=4, reply_bytes=3)
        c.sendall(b"ab")  # 2 < 4: its reply passes
        self.assertEqual(c.recv(100), b"AB")
        c.sendall(b"cdefgh")
        got, reset = read_all(c)
        self.assertEqual(got, b"CDE")
        self.assertTrue(reset)
        self.assertTrue(p.wait_cuts(1, 5))
        self.assertEqual((p.cuts, p.connections), (1, 1))
        self.assertFalse(p.armed)

    def test_h2_rule(self):
        settings = frame(4, 0, b"\0" * 6)

        def answer(stream):
            return (frame(4, 0, flags=1) + frame(8, 0, b"\0\0\0\1") + frame(1, stream, b"h" * 5)
                    + frame(0, stream, b"d" * 20000))

        def respond(data):
            if data.startswith(cut_proxy.H2_PREFACE):
                return settings
            return answer(struct.unpack(">I", data[5:9])[0])  # the call's stream
        be = Backend(respond)
        self.addCleanup(be.close)
        p = CutProxy("127.0.0.1", be.port)
        self.addCleanup(p.close)
        c = socket.create_connection(("127.0.0.1", p.port))
        self.addCleanup(c.close)
        c.sendall(cut_proxy.H2_PREFACE + frame(4, 0))
        self.assertEqual(c.recv(100), settings)
        # unarmed: a call's whole answer passes
        c.sendall(frame(1, 1, b"x" * 3) + frame(0, 1, b"y" * 10, flags=1))
        got = b""
        while len(got) < len(answer(1)):
            got += c.recv(65536)
        self.assertEqual(got, answer(1))
        p.cut_next_reply()
        # armed: the answer's frames before its HEADERS pass, the HEADERS and the rest do not
        c.sendall(frame(1, 3, b"x" * 3) + frame(0, 3, b"y" * 10, flags=1))
        got, reset = read_all(c)
        self.assertEqual(got, answer(3)[:answer(3).index(frame(1, 3, b"h" * 5))])
        self.assertTrue(reset)
        self.assertEqual(p.cuts, 1)

    def test_request_rule(self):
        """cut_after_request: the server gets the request up to its END_STREAM frame (split
        over several sends), nothing after, and no answer reaches the client."""
        got = []
        lock = threading.Lock()

        def respond(data):
            with lock:
                got.append(data)
            return b""
        be = Backend(respond)
        self.addCleanup(be.close)
        p = CutProxy("127.0.0.1", be.port)
        self.addCleanup(p.close)
        c = socket.create_connection(("127.0.0.1", p.port))
        self.addCleanup(c.close)
        hello = cut_proxy.H2_PREFACE + frame(4, 0) + frame(1, 1, b"x", flags=5)
        c.sendall(hello)
        self.assertTrue(es_wait(lambda: sum(map(len, got)) == len(hello)))
        p.cut_after_request()
        request = frame(1, 3, b"h" * 4, flags=4) + frame(0, 3, b"a" * 3000) + \
            frame(0, 3, b"b" * 5000, flags=1)
        after = frame(8, 0, b"\0\0\0\1") + frame(1, 5, b"n")
        c.sendall(request[:20])
        c.sendall(request[20:4000])
        c.sendall(request[4000:] + after)
        self.assertTrue(p.wait_cuts(1, 5))
        self.assertEqual(read_all(c), (b"", True))
        es_wait(lambda: False, 0.3)
        self.assertEqual(b"".join(got), hello + request)

    def test_parser_split_reads(self):
        """Frame headers split across reads are still found where they start."""
        data = frame(4, 0, b"\0" * 6) + frame(1, 5, b"abc") + frame(0, 5, b"z" * 70)
        for cut in range(1, len(data)):
            parser = cut_proxy._FrameParser()
            seen, base = [], 0
            for chunk in (data[:cut], data[cut:]):
                seen += [(base + off, t, s, n) for off, t, _f, s, n in parser.feed(chunk)]
                base += len(chunk)
            self.assertEqual(seen, [(0, 4, 0, 6), (15, 1, 5, 3), (27, 0, 5, 70)], cut)

    def test_cut_all_and_close(self):
        be = Backend(lambda d: d)
        self.addCleanup(be.close)
        p = CutProxy("127.0.0.1", be.port)
        cs = [socket.create_connection(("127.0.0.1", p.port)) for _ in range(3)]
        for c in cs:
            c.sendall(b"x")
            self.assertEqual(c.recv(10), b"x")
            self.addCleanup(c.close)
        self.assertEqual(p.cut_all(), 3)
        for c in cs:
            self.assertEqual(read_all(c)[0], b"")
        self.assertEqual(p.kills, 3)
        p.close()
        p.close()  # idempotent
        with self.assertRaises(OSError):
            socket.create_connection(("127.0.0.1", p.port), timeout=2).close()


if __name__ == "__main__":
    unittest.main(verbosity=2)
