"""The batch digest (python/embps/_digest.py; docs/design.md, "A batch's identity") and where it
goes on the wire, without a server.

The digest is checked three ways: against bytes laid out here by hand from the definition and
hashed by the xxhsum tool (Debian's xxhash; skipped with a message when it is absent), against
the C library's (common/digest.c, built alone for this test and called through ctypes; skipped
only when run by hand without $EMBPS_DIGEST_LIB), and by its properties (padding, the table name, the token
order, 0 never returned). Then the requests: every shard carries the same digest and attempt 0
(absent), and a retry's requests differ from the first attempt's only by their attempt field.
"""
import ctypes
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "python"))

from embps import _batch, _digest, _retry, _wire  # noqa: E402
from embps._names import pb  # noqa: E402

XXHSUM = shutil.which("xxhsum")
# digest("items", [1, 2, 3, 4], T=4), by xxhsum -H3 over layout()'s bytes
KNOWN_ITEMS_1234 = 0x4718b181456b70db


def layout(table, tokens, tokens_per_batch):
    """The digest's input, written out from the definition (not from _digest.py)."""
    name = table.encode("utf-8")
    toks = list(tokens) + [0] * (tokens_per_batch - len(tokens))
    return (b"embps-batch-v1" + struct.pack("<I", len(name)) + name
            + struct.pack("<I", tokens_per_batch) + struct.pack("<%dq" % len(toks), *toks))


def xxhsum_h3(data):
    """XXH3-64 (seed 0) of data by the xxhsum tool."""
    with tempfile.NamedTemporaryFile(prefix="embps-digest-", suffix=".bin") as f:
        f.write(data)
        f.flush()
        out = subprocess.run([XXHSUM, "-H3", f.name], check=True, capture_output=True,
                             text=True, timeout=30).stdout
    # "XXH3 (FILE) = 0123456789abcdef" (xxhsum 0.8); older ones print "HASH  FILE"
    word = out.split("=")[-1].split()[0] if "=" in out else out.split()[0]
    v = int(word, 16)
    return v or 1


CASES = [
    ("items", [1, 2, 3, 4], 4),
    ("items", [1, 2, 3], 4),  # a padded batch: one padding token 0 at the end
    ("t", [], 2),  # nothing but padding
    ("tâble-ñ", [7, 0, 2 ** 62, 5, 5, 9], 8),  # a UTF-8 name, token 0, a large token
    ("x" * 300, list(range(1000, 1257)), 258),  # a long name, >256 tokens
]


class DigestTest(unittest.TestCase):
    def test_definition_bytes(self):
        """The layout here and _digest.py's streaming agree (checked through xxhash itself,
        so this runs where xxhsum is absent)."""
        import xxhash
        for table, toks, t in CASES:
            a = np.array(toks, dtype="<i8")
            want = xxhash.xxh3_64(layout(table, toks, t), seed=0).intdigest() or 1
            self.assertEqual(_digest.digest(table, a, t), want, (table, toks, t))

    @unittest.skipUnless(XXHSUM, "xxhsum (Debian package xxhash) is not installed: the digest "
                         "is not compared with the reference tool")
    def test_against_xxhsum(self):
        for table, toks, t in CASES:
            a = np.array(toks, dtype="<i8")
            self.assertEqual(_digest.digest(table, a, t), xxhsum_h3(layout(table, toks, t)),
                             (table, toks, t))

    def test_known_value(self):
        """One value written down, so that a change to the definition cannot pass unseen (it
        would have to change this number too, and the C library's)."""
        a = np.array([1, 2, 3, 4], dtype="<i8")
        self.assertEqual(_digest.digest("items", a, 4), KNOWN_ITEMS_1234)

    def test_properties(self):
        a = np.array([5, 6, 7, 8], dtype="<i8")
        d = _digest.digest("t", a, 4)
        self.assertTrue(0 < d < 2 ** 64)
        self.assertEqual(d, _digest.digest(b"t", memoryview(a), 4))  # bytes name, any buffer
        self.assertNotEqual(d, _digest.digest("u", a, 4))  # the table counts
        self.assertNotEqual(d, _digest.digest("t", a[::-1].copy(), 4))  # so does the order
        self.assertNotEqual(d, _digest.digest("t", a, 6))  # and T (two more padding tokens)
        # the name's length is hashed: ("ab", T) differs from ("a", ...) with bytes moved over
        self.assertNotEqual(_digest.digest("ab", a[:0], 0), _digest.digest("a", a[:0], 0))
        with self.assertRaises(ValueError):
            _digest.digest("t", a, 3)  # more tokens than T


def c_digest():
    """The C library's embps_batch_digest_padded (common/digest.c) through ctypes, from
    $EMBPS_DIGEST_LIB (tests/python/CMakeLists.txt builds digest.c alone with its symbols
    visible), or None when the variable is unset (the test run by hand)."""
    path = os.environ.get("EMBPS_DIGEST_LIB")
    if not path:
        return None
    fn = ctypes.CDLL(path).embps_batch_digest_padded
    # uint64_t embps_batch_digest_padded(const char *table, uint32_t tokens_per_batch,
    #                                    const int64_t *tokens, uint64_t n)
    fn.restype = ctypes.c_uint64
    fn.argtypes = [ctypes.c_char_p, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint64]
    return fn


class CDigestTest(unittest.TestCase):
    def test_equals_c_library(self):
        fn = c_digest()
        if fn is None:
            self.skipTest("EMBPS_DIGEST_LIB is unset (ctest sets it): the Python digest is "
                          "compared with xxhsum only")
        for table, toks, t in CASES:
            a = np.array(toks, dtype="<i8")
            got = fn(table.encode(), t, a.ctypes.data if len(a) else None, len(a))
            self.assertEqual(_digest.digest(table, a, t), got, (table, toks, t))


class RequestTest(unittest.TestCase):
    """The digest and attempt on every shard's request."""

    def setUp(self):
        self.tok = np.array([11, 12, 13, 14, 15], dtype="<i8")
        self.plan = _batch.Plan(5, 3, True)  # T = 6: one padding token, on shard 2
        self.digest = _digest.digest("items", self.tok, self.plan.tokens_per_batch)

    def check(self, reqs, parse, kind):
        msgs = [parse(q) for q in reqs]
        for r, m in enumerate(msgs):
            self.assertEqual(m.digest, self.digest)
            self.assertEqual(m.attempt, 0)
            self.assertEqual(m.batch_id, 77)
            self.assertEqual(m.shard_index, r)
        whole = b"".join(m.tokens for m in msgs)
        self.assertEqual(_digest.digest("items", whole, 6), self.digest,
                         "the digest is of every shard's tokens in order, padding included")
        for attempt in (1, 2, 300):
            again = [parse(_wire.with_attempt(q, kind, attempt)) for q in reqs]
            for m0, m in zip(msgs, again):
                self.assertEqual(m.attempt, attempt)
                m.attempt = 0
                self.assertEqual(m, m0, "a retry changes nothing but the attempt")

    def test_lookup(self):
        reqs = _batch.lookup_requests("items", self.tok, self.plan, 3, 77, None, 9, self.digest)
        self.check(reqs, pb.LookupRequest.FromString, "lookup")

    def test_push(self):
        g = np.arange(5 * 4, dtype="<f4").reshape(5, 4)
        reqs = _batch.push_requests("items", self.tok, g, self.plan, 3, 77, 0, 9, self.digest)
        self.check(reqs, pb.PushGradientsRequest.FromString, "push")

    def test_retry_batch_requests(self):
        """_retry.Batch sends the current attempt's number."""
        reqs = _batch.lookup_requests("items", self.tok, self.plan, 3, 77, None, 9, self.digest)
        b = _retry.Batch("lookup", 77, reqs, None, _retry.Attempts(None, 4, None))
        self.assertEqual([q for q in b.requests()], reqs)
        b.schedule.attempt = 3
        self.assertEqual({pb.LookupRequest.FromString(q).attempt for q in b.requests()}, {3})


if __name__ == "__main__":
    unittest.main(verbosity=2)
