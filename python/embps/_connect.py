"""What a Client is given to reach its group, checked before anything is dialled: the servers'
addresses (by common/hostport.c's rules and with its messages, so the Python and C clients refuse
the same lists in the same words), the bearer token (given, or read from a token file as the CLI's
--token-file reads it) and the TLS credentials (PEM files or bytes turned into grpcio's channel
credentials).
"""
import os
import socket

import grpc

_DEFAULT_SERVERS = "127.0.0.1:7070"  # as the CLI's --servers


# ---- TLS --------------------------------------------------------------------------------------

def _pem(value, what):
    """A PEM argument's bytes: value itself when bytes, else the file it names."""
    if value is None or isinstance(value, (bytes, bytearray)):
        return None if value is None else bytes(value)
    try:
        with open(value, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError("%s %s: cannot read it: %s" % (what, value, e.strerror)) from None


def tls_credentials(ca, cert, key, server_name):
    """(channel credentials, extra channel options) for the Client's TLS arguments, or None for
    cleartext. grpcio offers ALPN h2 and checks the server's certificate and host name."""
    if (cert is None) != (key is None):
        raise ValueError("tls_cert and tls_key go together: give both (mutual TLS) or neither")
    if ca is None:
        if cert is not None or server_name is not None:
            raise ValueError("tls_cert, tls_key and tls_server_name need tls_ca: TLS verifies "
                             "the server too")
        return None
    creds = grpc.ssl_channel_credentials(root_certificates=_pem(ca, "tls_ca"),
                                         private_key=_pem(key, "tls_key"),
                                         certificate_chain=_pem(cert, "tls_cert"))
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return creds, options


# ---- addresses --------------------------------------------------------------------------------

def _refuse(text, tail):
    return ValueError("server address '%s'%s" % (text[:300], tail))


def check_address(text):
    """text ("host:port" or "[ipv6]:port") checked by common/hostport.c's rules, with its
    messages; returns the gRPC target for it."""
    if text.startswith("["):
        close = text.find("]")
        if close < 0 or close + 1 >= len(text) or text[close + 1] != ":":
            raise _refuse(text, " is not [ipv6]:port")
        host, port, ipv6 = text[1:close], text[close + 2:], True
    else:
        colon = text.rfind(":")
        if colon < 0:
            raise _refuse(text, " has no port (expected host:port)")
        host, port, ipv6 = text[:colon], text[colon + 1:], False
        if ":" in host:
            raise _refuse(text, ": write IPv6 hosts as [addr]:port")
    if not (port.isascii() and port.isdigit() and len(port) <= 5 and 1 <= int(port) <= 65535):
        raise _refuse(text, " has a bad port (expected 1..65535)")
    if not host:
        raise _refuse(text, " has an empty host")
    if ipv6:
        try:
            socket.inet_pton(socket.AF_INET6, host.split("%", 1)[0])
        except OSError:
            raise _refuse(text, ": '%s' is not an IPv6 address" % host[:64]) from None
        return "ipv6:" + text
    for c in host:
        if not (c.isascii() and (c.isalnum() or c in "-_.")):
            raise _refuse(text, " has a bad character %s in its host" %
                          ("'%s'" % c if c.isprintable() else "(byte 0x%02x)" % ord(c)))
    if ".." in host or host.startswith("."):
        raise _refuse(text, " has an empty label in its host")
    return text


def parse_servers(servers):
    """The group's addresses, in rank order, from "h:p,h:p", a sequence of "h:p", or (None)
    EMBPS_SERVERS, else 127.0.0.1:7070 as the CLI. Raises ValueError with the C client's
    messages."""
    if servers is None:
        servers = os.environ.get("EMBPS_SERVERS") or _DEFAULT_SERVERS
    items = servers.split(",") if isinstance(servers, str) else list(servers)
    if not items:
        raise ValueError("no server address given")
    out = []
    for s in items:
        if not isinstance(s, str):
            raise TypeError("server addresses are host:port strings, not %r" % (s,))
        s = s.strip()
        if not s:
            raise ValueError("empty server address in the list (expected "
                             "host:port[,host:port...])")
        check_address(s)
        out.append(s)
    return out


def read_token(token=None, token_file=None):
    """The bearer token to send: token as given, else token_file's text, else the file named by
    EMBPS_TOKEN_FILE (as the CLI's --token-file), else None. The file's surrounding whitespace
    (a trailing newline) is dropped; it must hold one token. Raises ValueError (both given, an
    empty file or one of several words, a token that is not visible ASCII) or OSError."""
    if token is not None and token_file is not None:
        raise ValueError("give token or token_file, not both")
    if token is None:
        path = token_file if token_file is not None else os.environ.get("EMBPS_TOKEN_FILE")
        if not path:
            return None
        with open(path, "rb") as f:
            data = f.read(1025)
        if len(data) > 1024:
            raise ValueError("token file %s is longer than 1024 bytes" % path)
        token = data.decode("ascii", "replace").strip()
        if not token:
            raise ValueError("token file %s is empty: it should hold one token" % path)
        if len(token.split()) > 1:
            raise ValueError("token file %s holds more than one word: it should hold one token "
                             "alone" % path)
    if not isinstance(token, str):
        raise TypeError("token must be a str, not %s" % type(token).__name__)
    if not token or any(not ("!" <= c <= "~") for c in token):
        raise ValueError("the token must be visible ASCII characters (no spaces or line breaks)")
    return token
