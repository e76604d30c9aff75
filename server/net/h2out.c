/* Output batches of the server's HTTP/2 core: what nghttp2 sends, as a list of segments for
 * the binding to write in order, instead of one byte buffer, so that reply bodies are never
 * copied. nghttp2_session_send runs with a send_callback that copies the small frames (HEADERS,
 * SETTINGS, frame headers) into owned chunks, and DATA frames use NGHTTP2_DATA_FLAG_NO_COPY so
 * send_data_callback only records pointers to the 5-byte prefix and into the handler's body.
 * A batch holds a reference on every body it points into (see embps__h2body_t), so a body
 * outlives its stream and its connection for as long as a batch still has to be written.
 *
 * DATA we send is as large as the peer's SETTINGS_MAX_FRAME_SIZE and windows allow (nghttp2
 * alone would cap it at 16 KiB without the read-length callback). */
#include <string.h>

#include "common/alloc.h"
#include "server/net/h2conn_internal.h"

/* A batch stops taking DATA beyond these so one write stays bounded (libuv splits iovecs at
 * IOV_MAX itself). A batch always takes at least one frame, so progress is guaranteed. */
#define BATCH_MAX_BYTES (32u << 20)
#define BATCH_MAX_SEGS 4096
#define CHUNK_MIN 16384

typedef struct chunk {
  struct chunk *next;
  size_t used, cap;
  uint8_t data[];
} chunk_t;

struct embps__h2out {
  embps__h2seg_t *segs;
  size_t nsegs, segs_cap;
  chunk_t *chunks; /* newest first; the head is the one being filled */
  embps__h2body_t **bodies;
  size_t nbodies, bodies_cap;
  size_t bytes;
  size_t body_bytes; /* of bytes, those of reply messages (DATA payload) */
};

void embps__h2body_unref(embps__h2body_t *b) {
  if (!b || --b->refs > 0)
    return;
  if (b->release)
    b->release(b->release_arg);
  embps_free(b);
}

embps__h2out_t *embps__h2out_new(void) { return embps_calloc(1, sizeof(embps__h2out_t)); }

void embps__h2out_free(embps__h2out_t *out) {
  if (!out)
    return;
  for (size_t i = 0; i < out->nbodies; i++)
    embps__h2body_unref(out->bodies[i]);
  while (out->chunks) {
    chunk_t *c = out->chunks;
    out->chunks = c->next;
    embps_free(c);
  }
  embps_free(out->bodies);
  embps_free(out->segs);
  embps_free(out);
}

const embps__h2seg_t *embps__h2out_segs(const embps__h2out_t *out, size_t *nsegs) {
  *nsegs = out->nsegs;
  return out->segs;
}

size_t embps__h2out_bytes(const embps__h2out_t *out) { return out->bytes; }

size_t embps__h2out_body_bytes(const embps__h2out_t *out) { return out->body_bytes; }

static int out_full(const embps__h2out_t *out) {
  return out->nsegs > 0 && (out->bytes >= BATCH_MAX_BYTES || out->nsegs >= BATCH_MAX_SEGS);
}

static int out_reserve_segs(embps__h2out_t *out, size_t more) {
  if (out->nsegs + more <= out->segs_cap)
    return 0;
  size_t cap = out->segs_cap ? out->segs_cap * 2 : 64;
  while (cap < out->nsegs + more)
    cap *= 2;
  embps__h2seg_t *segs = embps_realloc(out->segs, cap * sizeof(*segs));
  if (!segs)
    return -1;
  out->segs = segs;
  out->segs_cap = cap;
  return 0;
}

/* Copies len bytes into the batch, extending the last segment when it ends where they go. */
static int out_copy(embps__h2out_t *out, const uint8_t *data, size_t len) {
  chunk_t *c = out->chunks;
  if (!c || c->cap - c->used < len) {
    size_t cap = len > CHUNK_MIN ? len : CHUNK_MIN;
    c = embps_malloc(sizeof(*c) + cap);
    if (!c)
      return -1;
    c->used = 0;
    c->cap = cap;
    c->next = out->chunks;
    out->chunks = c;
  }
  uint8_t *dst = c->data + c->used;
  embps__h2seg_t *last = out->nsegs ? &out->segs[out->nsegs - 1] : NULL;
  if (last && last->base + last->len == dst) {
    last->len += len;
  } else {
    if (out_reserve_segs(out, 1) < 0)
      return -1;
    out->segs[out->nsegs++] = (embps__h2seg_t){dst, len};
  }
  memcpy(dst, data, len);
  c->used += len;
  out->bytes += len;
  return 0;
}

int embps__h2out_copy(embps__h2out_t *out, const uint8_t *data, size_t len) {
  return out_copy(out, data, len);
}

/* Points the batch at len bytes of b, taking a reference on b for the batch. */
static int out_ref(embps__h2out_t *out, embps__h2body_t *b, const uint8_t *data, size_t len) {
  if (out_reserve_segs(out, 1) < 0)
    return -1;
  if (out->nbodies == 0 || out->bodies[out->nbodies - 1] != b) {
    if (out->nbodies == out->bodies_cap) {
      size_t cap = out->bodies_cap ? out->bodies_cap * 2 : 8;
      embps__h2body_t **bodies = embps_realloc(out->bodies, cap * sizeof(*bodies));
      if (!bodies)
        return -1;
      out->bodies = bodies;
      out->bodies_cap = cap;
    }
    out->bodies[out->nbodies++] = b;
    b->refs++;
  }
  out->segs[out->nsegs++] = (embps__h2seg_t){data, len};
  out->bytes += len;
  out->body_bytes += len;
  return 0;
}

/* ---- nghttp2 callbacks: sending ---- */

static ssize_t send_cb(nghttp2_session *session, const uint8_t *data, size_t length, int flags,
                       void *user) {
  embps__h2conn_t *conn = user;
  if (!conn->out || out_full(conn->out))
    return NGHTTP2_ERR_WOULDBLOCK;
  if (out_copy(conn->out, data, length) < 0)
    return NGHTTP2_ERR_CALLBACK_FAILURE;
  return (ssize_t)length;
}

static ssize_t read_length_cb(nghttp2_session *session, uint8_t frame_type, int32_t stream_id,
                              int32_t session_window, int32_t stream_window,
                              uint32_t remote_max_frame_size, void *user) {
  /* nghttp2 clamps this to the windows; without the callback it would stop at 16 KiB. */
  return (ssize_t)remote_max_frame_size;
}

static int send_data_cb(nghttp2_session *session, nghttp2_frame *frame, const uint8_t *framehd,
                        size_t length, nghttp2_data_source *source, void *user) {
  embps__h2conn_t *conn = user;
  embps__h2out_t *out = conn->out;
  if (!out || out_full(out))
    return NGHTTP2_ERR_WOULDBLOCK;
  embps__h2stream_t *s = source->ptr;
  embps__h2body_t *b = s->body;
  static const uint8_t zeros[256];
  size_t padlen = frame->data.padlen;
  if (out_copy(out, framehd, 9) < 0)
    return NGHTTP2_ERR_CALLBACK_FAILURE;
  if (padlen > 0) {
    uint8_t pad = (uint8_t)(padlen - 1);
    if (out_copy(out, &pad, 1) < 0)
      return NGHTTP2_ERR_CALLBACK_FAILURE;
  }
  size_t off = s->sent_off;
  if (off < EMBPS__GRPC_PREFIX_LEN && length > 0) {
    size_t k = EMBPS__GRPC_PREFIX_LEN - off < length ? EMBPS__GRPC_PREFIX_LEN - off : length;
    if (out_ref(out, b, b->prefix + off, k) < 0)
      return NGHTTP2_ERR_CALLBACK_FAILURE;
    off += k;
    length -= k;
  }
  if (length > 0) {
    if (out_ref(out, b, b->data + (off - EMBPS__GRPC_PREFIX_LEN), length) < 0)
      return NGHTTP2_ERR_CALLBACK_FAILURE;
    off += length;
  }
  s->sent_off = off;
  if (padlen > 1 && out_copy(out, zeros, padlen - 1) < 0)
    return NGHTTP2_ERR_CALLBACK_FAILURE;
  return 0;
}

void embps__h2out_set_send_callbacks(nghttp2_session_callbacks *cbs) {
  nghttp2_session_callbacks_set_send_callback(cbs, send_cb);
  nghttp2_session_callbacks_set_send_data_callback(cbs, send_data_cb);
  nghttp2_session_callbacks_set_data_source_read_length_callback(cbs, read_length_cb);
}
