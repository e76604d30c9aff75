"""Tokens and gradients as the wire wants them (C-contiguous little-endian int64, f32 or bf16
bits), from numpy arrays, Python sequences or torch tensors, and the bf16 <-> f32 conversions.

Everything here works on whole arrays (numpy views, astype, min/max): no Python loop touches an
element. torch is never imported: a tensor is recognised by its .numpy() and .cpu() methods and
converted through them (bfloat16 tensors, which numpy cannot hold, through their int16 bits).
"""
import sys

import numpy as np

from .errors import ShapeError

_I8 = np.dtype("<i8")
_F4 = np.dtype("<f4")
_U2 = np.dtype("<u2")
_INT64_MAX = np.iinfo(np.int64).max


def _is_tensor(x):
    return not isinstance(x, np.ndarray) and hasattr(x, "numpy") and hasattr(x, "cpu")


def _tensor_to_numpy(t):
    """A torch tensor's values as a numpy array (bfloat16 as uint16 bits)."""
    if hasattr(t, "detach"):
        t = t.detach()
    t = t.cpu()
    if str(getattr(t, "dtype", "")) == "torch.bfloat16":
        torch = sys.modules["torch"]  # a tensor exists, so torch is imported
        return t.contiguous().view(torch.int16).numpy().view(_U2)
    return t.numpy()


def as_tokens(tokens, what, keyed=False):
    """tokens as a C-contiguous little-endian int64 numpy array (a view when it already is one).

    keyed: whether the table is hash-keyed (any int64 id is a key: negative ones are taken as
    they are, and uint64 ones beyond int64 as their int64 bits, the same 64-bit key), a bool or
    a function returning it, called only when a token is negative or beyond int64 (so a dense
    table's usual batch asks nothing). For a dense table those are refused here, since its ids
    lie in [0, rows).

    Raises ShapeError (not 1-D), TypeError (not integers) or ValueError (a dense table's negative
    token, or one beyond int64)."""
    a = _tensor_to_numpy(tokens) if _is_tensor(tokens) else tokens
    if not isinstance(a, np.ndarray):
        src = a
        a = np.asarray(src)
        if a.size == 0 and a.dtype.kind == "f":  # [] becomes float64
            a = a.astype(_I8)
        elif a.dtype.kind in "fO" and a.ndim == 1:
            # Python ints beyond int64 (uint64 keys) become float64 or object to numpy
            o = np.asarray(src, dtype=object)
            if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in o):
                a = _big_ints(o, what)
    if a.ndim != 1:
        raise ShapeError("%s: tokens must be a 1-D array of token ids, not an array of shape %s"
                         % (what, tuple(a.shape)), "flatten the tokens (tokens.reshape(-1))")
    if a.dtype.kind not in "iu":
        raise TypeError("%s: tokens must be integers, not %s" % (what, a.dtype))
    if a.size and a.dtype.kind == "u" and a.dtype.itemsize == 8:
        hi = int(a.max())
        if hi > _INT64_MAX:
            if not _keyed(keyed):
                raise ValueError("%s: token %d at position %d is beyond int64" %
                                 (what, hi, int(a.argmax())))
            return np.ascontiguousarray(a, dtype="<u8").view(_I8)
    if a.dtype != _I8 or not a.flags.c_contiguous:
        a = np.ascontiguousarray(a, dtype=_I8)
    if a.size and a.dtype.kind == "i":
        lo = int(a.min())
        if lo < 0 and not _keyed(keyed):
            raise ValueError("%s: token %d at position %d is negative: token ids lie in "
                             "[0, rows) (a hash-keyed table, made with capacity, takes any "
                             "int64 id)" % (what, lo, int(a.argmin())))
    return a


def _keyed(keyed):
    return bool(keyed() if callable(keyed) else keyed)


def _big_ints(a, what):
    """A 1-D object array of integers (some beyond int64) as uint64 or int64; ValueError for a
    value beyond both."""
    lo, hi = min(int(v) for v in a.ravel()), max(int(v) for v in a.ravel())
    if lo >= 0 and hi < 2**64:
        return a.astype(np.uint64)
    if lo >= -2**63 and hi <= _INT64_MAX:
        return a.astype(_I8)
    raise ValueError("%s: a token is beyond 64 bits (%d): keys are int64 or uint64 values"
                     % (what, lo if lo < -2**63 else hi))


def as_grads(grads, n, what):
    """grads as a C-contiguous 2-D numpy array of n rows: uint16 (bf16 bits) stays uint16,
    anything floating becomes little-endian f32. Raises ShapeError or TypeError."""
    a = _tensor_to_numpy(grads) if _is_tensor(grads) else grads
    if not isinstance(a, np.ndarray):
        a = np.asarray(a, dtype=_F4)
    if a.ndim != 2 or a.shape[0] != n:
        raise ShapeError("%s: grads must hold one row per token, shape (%d, emb_width), not %s"
                         % (what, n, tuple(a.shape)),
                         "pass a 2-D array with a gradient row for each token")
    if a.dtype == _U2 or a.dtype == np.uint16:
        want = _U2
    elif a.dtype.kind == "f":
        want = _F4
    else:
        raise TypeError("%s: grads must be floating point (or uint16 holding bf16 bits), not %s"
                        % (what, a.dtype))
    if a.dtype != want or not a.flags.c_contiguous:
        a = np.ascontiguousarray(a, dtype=want)
    return a


def bf16_to_f32(bits, out=None):
    """bf16 bits (uint16) to float32: the high half of the f32 bits (exact)."""
    if out is None:
        out = np.empty(bits.shape, _F4)
    np.left_shift(bits, 16, out=out.view(np.uint32), dtype=np.uint32)
    return out


def f32_to_bf16(f):
    """float32 to bf16 bits, rounding to nearest even; NaN stays NaN (quiet), as
    common/dtype.h's embps_f32_to_bf16."""
    u = np.ascontiguousarray(f, dtype=_F4).view(np.uint32)
    out = ((u + (((u >> 16) & 1) + np.uint32(0x7FFF))) >> 16).astype(_U2)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        out[nan] = ((u[nan] >> 16) | np.uint32(0x40)).astype(_U2)
    return out
