"""The message classes of proto/, built at first import from a descriptor set that protoc
generates once per version of the .proto files and keeps in a cache.

Nothing generated is committed. The .proto files are found, in this order:
  1. $EMBPS_PROTO_DIR (a directory holding embps/v1/embps.proto and grpc/health/v1/health.proto);
  2. the package's own copy, embps/_proto/ (python/setup.py puts it there when it builds or
     installs the package, so an installed copy needs no source tree);
  3. the source tree, ../../proto relative to this file (running from a checkout with
     PYTHONPATH=python).
Their bytes are hashed. A descriptor set (protoc --descriptor_set_out, one binary file) for that
hash is looked for in embps/_proto/ (shipped by setup.py when it could run protoc), then in the
cache ($EMBPS_CACHE_DIR, else $XDG_CACHE_HOME/embps or ~/.cache/embps, else a per-user folder
in the temporary directory); when none exists, grpc_tools.protoc (Debian's python3-grpc-tools,
pip's grpcio-tools) writes one into the first writable of those, under a temporary name renamed
into place, so concurrent first imports do not see half a file.

Why a descriptor set in a private pool rather than generated *_pb2.py modules: generated modules
would be named embps.v1.embps_pb2 (shadowing or shadowed by this package, which is also called
embps) and would register embps.v1 in protobuf's default pool, where a second copy of the same
proto under another file name (tests generate their own stubs) is a duplicate-symbol error. A
private DescriptorPool has neither problem, and one file per proto version is all the cache
holds.
"""
import hashlib
import os
import tempfile

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PROTO_FILES = ("embps/v1/embps.proto", "grpc/health/v1/health.proto")

_HERE = os.path.dirname(os.path.abspath(__file__))


def proto_dir():
    """The directory whose PROTO_FILES this package speaks (see the module comment)."""
    env = os.environ.get("EMBPS_PROTO_DIR")
    if env:
        candidates = [env]
    else:
        candidates = [os.path.join(_HERE, "_proto"),
                      os.path.join(os.path.dirname(os.path.dirname(_HERE)), "proto")]
    for d in candidates:
        if all(os.path.isfile(os.path.join(d, f)) for f in PROTO_FILES):
            return d
    raise ImportError("embps: cannot find %s in %s: run from the source tree (PYTHONPATH=python), "
                      "install the package with python/setup.py (which copies proto/ into it), "
                      "or set EMBPS_PROTO_DIR to embps's proto/ directory"
                      % (" and ".join(PROTO_FILES), " or ".join(candidates)))


def proto_hash(pdir):
    """16 hex digits of SHA-256 over the proto files' names and bytes."""
    h = hashlib.sha256()
    for f in PROTO_FILES:
        with open(os.path.join(pdir, f), "rb") as fp:
            data = fp.read()
        h.update(f.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return h.hexdigest()[:16]


def descriptor_name(digest):
    return "stubs-%s.desc" % digest


def cache_dirs():
    """Where generated descriptor sets are kept, most preferred first."""
    dirs = []
    if os.environ.get("EMBPS_CACHE_DIR"):
        dirs.append(os.environ["EMBPS_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    dirs.append(os.path.join(xdg, "embps"))
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    dirs.append(os.path.join(tempfile.gettempdir(), "embps-cache-%s" % uid))
    return dirs


def generate(pdir, path):
    """Runs protoc over pdir's PROTO_FILES and writes the descriptor set to path atomically."""
    try:
        from grpc_tools import protoc
    except ImportError as e:
        raise ImportError("embps: the message descriptors for %s are not built yet and "
                          "grpc_tools is missing to build them: install python3-grpc-tools "
                          "(Debian) or grpcio-tools (pip) once (%s)" % (pdir, e)) from None
    d = os.path.dirname(path)
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".stubs-", suffix=".tmp", dir=d)
    os.close(fd)
    try:
        rc = protoc.main(["protoc", "-I" + pdir, "--include_imports",
                          "--descriptor_set_out=" + tmp, *PROTO_FILES])
        if rc != 0:
            raise ImportError("embps: protoc failed (exit %d) on %s in %s"
                              % (rc, PROTO_FILES, pdir))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def descriptor_set_bytes():
    """The serialized FileDescriptorSet of PROTO_FILES, from the package, the cache or protoc."""
    pdir = proto_dir()
    name = descriptor_name(proto_hash(pdir))
    shipped = os.path.join(_HERE, "_proto", name)
    if os.path.isfile(shipped):
        with open(shipped, "rb") as f:
            return f.read()
    errors = []
    for d in cache_dirs():
        path = os.path.join(d, name)
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError:
            pass
        try:
            generate(pdir, path)
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:  # not writable: try the next place
            errors.append("%s: %s" % (d, e))
    raise ImportError("embps: no writable cache directory for the message descriptors (%s); set "
                      "EMBPS_CACHE_DIR" % "; ".join(errors))


class Messages:
    """The message classes and enum numbers of embps.v1 and grpc.health.v1, from a private
    descriptor pool. Message classes are attributes by short name (m.LookupRequest)."""

    def __init__(self, data):
        self.pool = descriptor_pool.DescriptorPool()
        fds = descriptor_pb2.FileDescriptorSet.FromString(data)
        for f in fds.file:
            self.pool.AddSerializedFile(f.SerializeToString())
        get_class = getattr(message_factory, "GetMessageClass", None)
        if get_class is None:  # protobuf < 4.24
            get_class = message_factory.MessageFactory(self.pool).GetPrototype
        for pkg in ("embps.v1", "grpc.health.v1"):
            fdesc = self.pool.FindFileByName(
                "embps/v1/embps.proto" if pkg == "embps.v1" else "grpc/health/v1/health.proto")
            for short, desc in fdesc.message_types_by_name.items():
                setattr(self, short, get_class(desc))

    def enum(self, full_name):
        """{value name: number} of an enum type, e.g. enum("embps.v1.DType")."""
        return {v.name: v.number for v in self.pool.FindEnumTypeByName(full_name).values}

    def fields(self, message):
        """{field name: (number, type)} of a message type given by full name."""
        d = self.pool.FindMessageTypeByName(message)
        return {f.name: (f.number, f.type) for f in d.fields}


_messages = None


def messages():
    """The process's Messages, built on first use."""
    global _messages
    if _messages is None:
        _messages = Messages(descriptor_set_bytes())
    return _messages
