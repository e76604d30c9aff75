"""A TCP proxy on loopback that cuts a connection mid-reply, for tests of retries.

    p = CutProxy("127.0.0.1", server_port)     # listens on 127.0.0.1:p.port, forwards there
    p.cut_next_reply()                         # arm: cut the next reply (rule below)
    ... a call through p.port fails with a broken connection (UNAVAILABLE in gRPC) ...
    p.wait_cuts(1, timeout=10); p.cuts, p.connections
    p.close()

Every accepted connection gets one daemonic thread that moves bytes both ways (select with a
0.2 s tick, so close() is noticed) and one outgoing connection to the target. Nothing is
changed in the bytes; a cut closes both sockets with SO_LINGER 0, so each side sees a reset
(ECONNRESET) at once rather than an orderly FIN.

When the cut happens (the rule). cut_next_reply() arms the proxy once; the first connection
that meets the rule is cut and the proxy disarms itself (cuts += 1).
  - HTTP/2 in cleartext (the client's first 24 bytes are the HTTP/2 connection preface, which
    is what grpcio and the embps C client send on an insecure channel) and reply_bytes None:
    both directions are parsed into frames (9-byte headers only; payloads are skipped by
    length). The connection is cut just before the server's first HEADERS frame (type 0x1) on a
    stream the client opened (sent HEADERS on) after arming, once the client has sent at least
    after_request_bytes bytes (default 0) since arming. The server's own frames that come
    before it (SETTINGS, SETTINGS ACK, WINDOW_UPDATE, PING) are forwarded, so the cut falls
    exactly after the server decided its answer and before the client reads any of it: for an
    embps server, which sends a response's HEADERS only with its answer, the call's work is
    done (a push is applied or not) and its caller cannot know which.
  - Any other stream (TLS, or reply_bytes given): once the client has sent at least
    after_request_bytes bytes (default 1) since arming, the next reply_bytes (default 0) bytes
    from the server are forwarded and the connection is cut at the byte after them (the rest of
    that read is dropped). For TLS this is only as precise as the byte counts the test chooses.
Calls already in flight when the proxy is armed are not the target in HTTP/2 mode (their streams
were opened before arming); in byte mode any reply counts.

cut_after_request() arms the other side: the cut comes just after the client's request is
forwarded whole (the frame with END_STREAM on a stream opened after arming), before any reply.

cut_all() cuts every live connection now (counted in kills, not cuts). Standard library only.
"""
import select
import socket
import struct
import threading
import time

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_TICK = 0.2  # seconds between checks of the closed flag in every loop
_CHUNK = 65536
_HEADERS = 0x1
_END_STREAM = 0x1


class _FrameParser:
    """Walks HTTP/2 frames in one direction of a stream of bytes, chunk by chunk. feed(data)
    yields (offset, type, flags, stream_id, length) for every frame header that completes
    inside data; offset is where that frame's header starts in data (negative when it began in
    an earlier chunk), length its payload's bytes."""

    def __init__(self, skip=0):
        self.skip = skip  # bytes to pass before the first frame (the client's preface)
        self.head = b""  # a frame header being assembled
        self.head_start = 0  # where it began, relative to the current chunk
        self.payload_left = 0

    def feed(self, data):
        i, n = 0, len(data)
        while i < n:
            if self.skip:
                k = min(self.skip, n - i)
                self.skip -= k
                i += k
            elif self.payload_left:
                k = min(self.payload_left, n - i)
                self.payload_left -= k
                i += k
            else:
                if not self.head:
                    self.head_start = i
                k = min(9 - len(self.head), n - i)
                self.head += data[i:i + k]
                i += k
                if len(self.head) == 9:
                    length = int.from_bytes(self.head[0:3], "big")
                    ftype, flags = self.head[3], self.head[4]
                    stream = struct.unpack(">I", self.head[5:9])[0] & 0x7FFFFFFF
                    self.head, self.payload_left = b"", length
                    yield self.head_start, ftype, flags, stream, length
        # a header still being assembled began in this chunk: relative to the next one it starts
        # len(data) bytes earlier
        if self.head:
            self.head_start -= n


class _Arm:
    def __init__(self, generation, after_request_bytes, reply_bytes, request=False):
        self.generation = generation
        self.after_request_bytes = after_request_bytes
        self.reply_bytes = reply_bytes
        self.request = request  # cut_after_request: the cut is on the client's side


class _Conn:
    """One proxied connection: client socket c, server socket s, per-arm counters."""

    def __init__(self, proxy, c, s):
        self.proxy, self.c, self.s = proxy, c, s
        self.first = b""  # the client's first bytes, until the preface is decided
        self.h2 = None  # None: not decided yet; True/False
        self.up = _FrameParser(skip=len(H2_PREFACE))
        self.down = _FrameParser()
        self.generation = -1  # the arm these counters belong to
        self.req_since_arm = 0
        self.streams_since_arm = set()
        self.reply_seen = 0  # byte mode: server bytes since the client reached its count
        self.up_pos = 0  # client bytes forwarded so far
        self.up_cut = None  # cut_after_request: the client byte position to cut at
        self.dead = False

    def _sync_arm(self, arm):
        if arm is not None and arm.generation != self.generation:
            self.generation = arm.generation
            self.req_since_arm = 0
            self.streams_since_arm = set()
            self.reply_seen = 0
            self.up_cut = None

    def client_bytes(self, data):
        """Bytes from the client: counted (and parsed), then forwarded, up to the cut when a
        cut_after_request rule is met. Returns False when the connection was cut."""
        if self.h2 is None:
            self.first += data[:len(H2_PREFACE) - len(self.first)]
            if len(self.first) == len(H2_PREFACE) or not H2_PREFACE.startswith(self.first):
                self.h2 = self.first == H2_PREFACE
        frames = list(self.up.feed(data)) if self.h2 is not False else []
        cut_at = None
        with self.proxy._lock:
            arm = self.proxy._arm
            self._sync_arm(arm)
            if arm is not None:
                before = self.req_since_arm
                self.req_since_arm += len(data)
                for off, ftype, flags, stream, length in frames:
                    if ftype == _HEADERS and stream:
                        self.streams_since_arm.add(stream)
                    if (arm.request and self.h2 and self.up_cut is None and flags & _END_STREAM
                            and stream in self.streams_since_arm and ftype in (0, _HEADERS)):
                        self.up_cut = self.up_pos + off + 9 + length
                if arm.request and not self.h2 and self.up_cut is None:
                    need = arm.after_request_bytes or 1
                    if self.req_since_arm >= need:
                        self.up_cut = self.up_pos + need - before
                if (arm.request and self.up_cut is not None
                        and self.up_pos + len(data) >= self.up_cut):
                    cut_at = self.up_cut - self.up_pos
                    self.proxy._arm = None
                    self.proxy.cuts += 1
        if cut_at is None:
            self.s.sendall(data)
            self.up_pos += len(data)
            return True
        if cut_at:
            self.s.sendall(data[:cut_at])
        self._cut()
        return False

    def _cut(self):
        self.close(reset=True)
        with self.proxy._cond:
            self.proxy._cond.notify_all()

    def server_bytes(self, data):
        """Bytes from the server: forwarded, up to the cut when the armed rule is met there.
        Returns False when the connection was cut."""
        # the parser sees every server byte (nghttp2 may send its SETTINGS before the client's
        # preface has arrived), so that it stays aligned on frame boundaries
        frames = list(self.down.feed(data)) if self.h2 is not False else []
        with self.proxy._lock:
            arm = self.proxy._arm
            self._sync_arm(arm)
            cut_at = None
            if arm is not None and arm.request:
                pass  # cut_after_request: the client's side decides
            elif arm is not None and self.h2 and arm.reply_bytes is None:
                need = arm.after_request_bytes or 0
                for off, ftype, _flags, stream, _length in frames:
                    if (ftype == _HEADERS and stream in self.streams_since_arm
                            and self.req_since_arm >= need):
                        cut_at = max(0, off)
                        break
            elif arm is not None:
                need = 1 if arm.after_request_bytes is None else arm.after_request_bytes
                if self.req_since_arm >= need:
                    allowed = (arm.reply_bytes or 0) - self.reply_seen
                    if allowed < len(data):
                        cut_at = max(0, allowed)
                    self.reply_seen += len(data)
            if cut_at is not None:
                self.proxy._arm = None
                self.proxy.cuts += 1
        if cut_at is None:
            self.c.sendall(data)
            return True
        if cut_at:
            self.c.sendall(data[:cut_at])
        self._cut()
        return False

    def close(self, reset=False):
        if self.dead:
            return
        self.dead = True
        for sock in (self.c, self.s):
            if reset:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                except OSError:
                    pass
            try:
                sock.close()
            except OSError:
                pass

    def run(self):
        try:
            while not self.dead and not self.proxy._closed:
                try:
                    ready, _, _ = select.select([self.c, self.s], [], [], _TICK)
                except (OSError, ValueError):
                    break
                for sock in ready:
                    if self.dead:
                        break
                    try:
                        data = sock.recv(_CHUNK)
                    except OSError:
                        data = b""
                    if not data:
                        self.close()
                        break
                    try:
                        forwarded = (self.client_bytes(data) if sock is self.c
                                     else self.server_bytes(data))
                        if not forwarded:
                            break
                    except OSError:
                        self.close()
                        break
        finally:
            self.close()
            with self.proxy._lock:
                self.proxy._live.discard(self)


class CutProxy:
    """Listens on listen_host (127.0.0.1) at an ephemeral port (port) and forwards every
    connection to target_host:target_port. Counters: connections (accepted), cuts (armed cuts
    done), kills (connections closed by cut_all). See the module's comment for the cut rule."""

    def __init__(self, target_host, target_port, listen_host="127.0.0.1", connect_timeout=5.0):
        self.target = (target_host, int(target_port))
        self.connect_timeout = connect_timeout
        self.connections = 0
        self.cuts = 0
        self.kills = 0
        self.refused = 0  # connections whose target could not be reached
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._arm = None
        self._generation = 0
        self._closed = False
        self._live = set()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((listen_host, 0))
        self._listener.listen(64)
        self._listener.settimeout(_TICK)
        self.port = self._listener.getsockname()[1]
        self.address = "%s:%d" % (listen_host, self.port)
        self._thread = threading.Thread(target=self._accept_loop, name="cut-proxy-accept",
                                        daemon=True)
        self._thread.start()

    def _accept_loop(self):
        while not self._closed:
            try:
                c, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            try:
                s = socket.create_connection(self.target, timeout=self.connect_timeout)
            except OSError:
                with self._lock:
                    self.refused += 1
                c.close()
                continue
            for sock in (c, s):
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(self, c, s)
            with self._lock:
                if self._closed:
                    conn.close()
                    break
                self.connections += 1
                self._live.add(conn)
            threading.Thread(target=conn.run, name="cut-proxy-conn", daemon=True).start()

    def cut_next_reply(self, after_request_bytes=None, reply_bytes=None):
        """Arms the proxy to cut the next reply (see the module's comment for the rule); a
        second call before the cut re-arms it with the new values and counters from zero."""
        with self._lock:
            self._generation += 1
            self._arm = _Arm(self._generation, after_request_bytes, reply_bytes)

    def cut_after_request(self, after_request_bytes=None):
        """Arms the proxy to cut the next request as soon as the server has all of it, before
        the server can answer: on HTTP/2 in cleartext, just after forwarding the client's frame
        that ends (END_STREAM) a stream opened after arming; otherwise after forwarding
        after_request_bytes (default 1) client bytes since arming. For an embps rank the shard
        has then arrived whole and its connection is reset at once: the rank withdraws the shard
        unless its batch was ordered meanwhile (a race the caller's test must accept)."""
        with self._lock:
            self._generation += 1
            self._arm = _Arm(self._generation, after_request_bytes, None, request=True)

    def disarm(self):
        """Cancels an armed cut that has not happened."""
        with self._lock:
            self._arm = None

    @property
    def armed(self):
        with self._lock:
            return self._arm is not None

    def wait_cuts(self, n=1, timeout=10.0):
        """Waits until cuts >= n, at most timeout seconds; returns whether it got there."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.cuts < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, _TICK))
            return True

    def live(self):
        """How many proxied connections are open now."""
        with self._lock:
            return len(self._live)

    def cut_all(self):
        """Resets every live connection now; returns how many."""
        with self._lock:
            conns = list(self._live)
            self.kills += len(conns)
        for conn in conns:
            conn.close(reset=True)
        return len(conns)

    def close(self):
        """Stops accepting, cuts every live connection, joins the accept thread (bounded).
        Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._live)
        try:
            self._listener.close()
        except OSError:
            pass
        for conn in conns:
            conn.close(reset=True)
        self._thread.join(timeout=2.0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
