/* In-place reads of large request messages (cleartext connections).
 *
 * A request message of EMBPS__H2_DIRECT_MIN bytes or more (a push's gradients, megabytes) would
 * otherwise be read into the binding's buffer and copied out of it into the message buffer by
 * grpc_frame.c. Instead the core follows the client's frames as their bytes are fed (the
 * connection preface, then each frame's 9-byte header and its payload: common/h2frames.h), and
 * when the next bytes are the payload of an unpadded DATA frame of such a message, tells the
 * binding to read them straight into the message buffer at the place they belong
 * (embps__h2conn_read_target). The binding then feeds exactly what it read; grpc_frame.c finds
 * the bytes already in place and counts them instead of copying. While such a message is
 * arriving, reads into the binding's own buffer stop at the end of the next frame header, so
 * that the payload after it can again be read in place. A read in place takes as much as the
 * socket holds, up to the end of the frame and of the message. */
#include <stdint.h>

#include "server/net/h2conn_internal.h"

void embps__h2read_track(embps__h2conn_t *conn, const uint8_t *p, size_t n) {
  size_t k = conn->preface_left < n ? conn->preface_left : n;
  conn->preface_left -= k;
  embps_h2_frames_walk(&conn->frames, p + k, n - k);
}

/* The stream id's message buffer, when it is receiving a message with at least
 * EMBPS__H2_DIRECT_MIN bytes still to come. */
static embps__h2stream_t *large_message(embps__h2conn_t *conn, int32_t id) {
  embps__h2stream_t *s = id ? nghttp2_session_get_stream_user_data(conn->session, id) : NULL;
  return s && s->state == EMBPS__H2S_RECEIVING && s->in_msg &&
                 s->msg_len - s->msg_got >= EMBPS__H2_DIRECT_MIN
             ? s
             : NULL;
}

uint8_t *embps__h2conn_read_target(embps__h2conn_t *conn, size_t *cap) {
  *cap = SIZE_MAX;
  if (conn->fatal || conn->preface_left > 0)
    return NULL;
  const embps_h2_frames_t *f = &conn->frames;
  const int32_t id = embps_h2_frames_data_stream(f);
  embps__h2stream_t *s = large_message(conn, id);
  if (s) {
    size_t left = s->msg_len - s->msg_got;
    conn->direct_stream = id;
    *cap = left < f->left ? left : f->left;
    return s->msg + s->msg_got;
  }
  if (!large_message(conn, conn->direct_stream)) {
    conn->direct_stream = 0;
    return NULL;
  }
  /* A large message is arriving: stop at the end of the next frame header. */
  *cap = f->have < EMBPS_H2_FRAME_HEADER ? EMBPS_H2_FRAME_HEADER - f->have
                                         : f->left + EMBPS_H2_FRAME_HEADER;
  return NULL;
}

uint64_t embps__h2conn_direct_bytes(const embps__h2conn_t *conn) { return conn->direct_bytes; }
