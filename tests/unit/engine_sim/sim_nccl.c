/* The NCCL backend's API (the EMBPS_HAVE_NCCL part of server/comm/comm.h) for the CUDA
 * simulator, so that the CUDA server's whole path (server/group/formation.c's join_nccl handing the
 * unique id out over the control plane, the communicator, the engine) runs in real server processes
 * with no GPU and no NCCL.
 *
 * Rendezvous over loopback TCP. embps_comm_nccl_unique_id opens a listening socket on 127.0.0.1
 * (the "root") and writes its port and a random nonce into the id; the socket stays open in this
 * process, found again by the nonce, as NCCL's bootstrap root lives on in the process that made
 * the id. So rank 0 must call embps_comm_nccl_new in the process that made the id (formation.c's
 * leader does both). Every other rank opens its own listener, connects to the root and sends a
 * hello (nonce, rank, size, its listener's port, its device's PCI bus id); once all size-1 ranks
 * have joined, the root checks that no two ranks share a device (NCCL refuses a duplicate GPU)
 * and sends every rank the table of ports. Each hello connection becomes the data connection
 * between that rank and rank 0; rank i then connects to ranks 1..i-1 and accepts from ranks
 * i+1..size-1 (each connection opens with a short peer hello naming its rank), which completes the
 * full mesh without any rank waiting on another's accept: the listeners exist before the root's
 * table names them. Every wait is bounded by the creation's timeout (10 minutes when timeout_ms
 * is 0, so that a test never hangs); a rank that never joins fails the others with
 * EMBPS_UNAVAILABLE naming the missing ranks.
 *
 * The collectives are the TCP backend's (embps_comm_tcp_new over the mesh, timeout_ms per call),
 * wrapped to take device buffers as NCCL does: every call makes the communicator's device
 * current, checks that its buffers are device memory of that device (a host pointer aborts with
 * the simulator's message, as it would fault on a GPU), synchronizes the engine's stream (NCCL
 * enqueues on it and the real backend waits for it to be idle) and then moves the bytes with the
 * device's memory opened for host access (sim_cuda_device_access_begin/end). all_reduce is the
 * TCP backend's rank-order reduction, so results are bitwise those of the real backend and of the
 * CPU servers. The argument checks and the stats are the dispatcher's (server/comm/comm.c), as
 * for the real backend. */
#include <cuda_runtime_api.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/alloc.h"
#include "common/log.h"
#include "server/comm/comm.h"
#include "sim_cuda.h"
#include "sim_nccl.h"

#ifndef EMBPS_HAVE_NCCL
#error "sim_nccl.c implements comm.h's EMBPS_HAVE_NCCL part: build it with EMBPS_HAVE_NCCL=1"
#endif

/* The id: magic, the root's port (little endian), the creating process's pid (for messages)
 * and a nonce that names the root's socket in that process; the rest is zero. */
#define ID_MAGIC "SIMNCCL1"
#define ID_MAGIC_BYTES 8
#define NONCE_BYTES 16
#define BUS_ID_BYTES 32
#define MAX_ROOTS 32   /* ids made and not yet taken by a rank 0, per process */
#define MAX_RANKS 1024 /* as the server's --peers */
#define LISTEN_BACKLOG 128
/* The bound on a creation whose timeout_ms is 0 ("no bound" in comm.h): a simulator in a test
 * must never hang. */
#define UNBOUNDED_CREATE_MS (10u * 60u * 1000u)

typedef struct id_fields {
  uint16_t port;
  uint32_t pid;
  uint8_t nonce[NONCE_BYTES];
} id_fields_t;

/* rank -> root, on the connection that becomes their data connection */
typedef struct hello {
  uint8_t magic[ID_MAGIC_BYTES];
  uint8_t nonce[NONCE_BYTES];
  uint32_t rank, size;
  uint16_t port; /* the rank's own listener */
  uint16_t pad;
  int32_t device;
  char bus_id[BUS_ID_BYTES];
} hello_t;

/* root -> rank: status (EMBPS_OK, or why the creation failed), then on EMBPS_OK size ports */
typedef struct verdict {
  uint32_t status;
  char message[200];
} verdict_t;

/* rank i -> rank j < i, on the connection that becomes their data connection */
typedef struct peer_hello {
  uint8_t magic[ID_MAGIC_BYTES];
  uint8_t nonce[NONCE_BYTES];
  uint32_t rank;
} peer_hello_t;

/* Roots made by this process and not yet taken by a rank 0. */
static pthread_mutex_t roots_mu = PTHREAD_MUTEX_INITIALIZER;
static struct root {
  int fd; /* -1: free slot */
  uint8_t nonce[NONCE_BYTES];
} roots[MAX_ROOTS];
static int roots_used;

typedef struct sim_comm {
  embps_comm_t base;
  embps_comm_t *tcp;
  cudaStream_t stream; /* the engine's; borrowed */
  int device;
} sim_comm_t;

static uint64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* ---- sockets, every wait bounded by the deadline -------------------------------------------- */

/* Waits until fd is ready for `events`; EMBPS_OK, or EMBPS_UNAVAILABLE when the deadline passed
 * or poll failed (err says which, naming `what`). */
static embps_status_t wait_ready(int fd, short events, uint64_t deadline, const char *what,
                                 embps_error_t *err) {
  for (;;) {
    uint64_t now = now_ms();
    struct pollfd pfd = {.fd = fd, .events = events};
    int rc;
    if (now >= deadline)
      return embps_error_set(err, EMBPS_UNAVAILABLE, "timed out %s", what);
    rc = poll(&pfd, 1, (int)(deadline - now < 1000 ? deadline - now : 1000));
    if (rc > 0)
      return EMBPS_OK;
    if (rc < 0 && errno != EINTR)
      return embps_error_set(err, EMBPS_UNAVAILABLE, "poll failed %s: %s", what, strerror(errno));
  }
}

static embps_status_t send_exact(int fd, const void *buf, size_t n, uint64_t deadline,
                                 const char *what, embps_error_t *err) {
  const uint8_t *p = buf;
  embps_status_t ret;
  while (n > 0) {
    ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
    if (k > 0) {
      p += k;
      n -= (size_t)k;
    } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      if ((ret = wait_ready(fd, POLLOUT, deadline, what, err)) != EMBPS_OK)
        return ret;
    } else {
      return embps_error_set(err, EMBPS_UNAVAILABLE, "connection lost %s: %s", what,
                             k < 0 ? strerror(errno) : "nothing sent");
    }
  }
  return EMBPS_OK;
}

/* Reads exactly n bytes (never more, so that what follows stays for the TCP backend). */
static embps_status_t recv_exact(int fd, void *buf, size_t n, uint64_t deadline, const char *what,
                                 embps_error_t *err) {
  uint8_t *p = buf;
  embps_status_t ret;
  while (n > 0) {
    ssize_t k = recv(fd, p, n, 0);
    if (k > 0) {
      p += k;
      n -= (size_t)k;
    } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      if ((ret = wait_ready(fd, POLLIN, deadline, what, err)) != EMBPS_OK)
        return ret;
    } else {
      return embps_error_set(err, EMBPS_UNAVAILABLE, "connection closed %s%s%s", what,
                             k < 0 ? ": " : "", k < 0 ? strerror(errno) : "");
    }
  }
  return EMBPS_OK;
}

/* A non-blocking listener on 127.0.0.1 on a port the kernel picks; -1 with err set. */
static int open_listener(uint16_t *port, embps_error_t *err) {
  struct sockaddr_in a;
  socklen_t len = sizeof(a);
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    embps_error_set(err, EMBPS_UNAVAILABLE, "simulated NCCL: socket: %s", strerror(errno));
    return -1;
  }
  memset(&a, 0, sizeof(a));
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  if (bind(fd, (struct sockaddr *)&a, sizeof(a)) != 0 || listen(fd, LISTEN_BACKLOG) != 0 ||
      getsockname(fd, (struct sockaddr *)&a, &len) != 0) {
    embps_error_set(err, EMBPS_UNAVAILABLE, "simulated NCCL: cannot listen on 127.0.0.1: %s",
                    strerror(errno));
    close(fd);
    return -1;
  }
  *port = ntohs(a.sin_port);
  return fd;
}

/* Connects to 127.0.0.1:port within the deadline; -1 with err set. A refused connection fails
 * at once: the listener exists from before its port was handed out, so it is gone. */
static int connect_loopback(uint16_t port, uint64_t deadline, const char *what,
                            embps_error_t *err) {
  struct sockaddr_in a;
  int so_error = 0;
  socklen_t len = sizeof(so_error);
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    embps_error_set(err, EMBPS_UNAVAILABLE, "simulated NCCL: socket: %s", strerror(errno));
    return -1;
  }
  memset(&a, 0, sizeof(a));
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  if (connect(fd, (struct sockaddr *)&a, sizeof(a)) == 0)
    return fd;
  if (errno != EINPROGRESS && errno != EINTR) {
    embps_error_set(err, EMBPS_UNAVAILABLE, "cannot connect to %s at 127.0.0.1:%u: %s", what, port,
                    strerror(errno));
    close(fd);
    return -1;
  }
  embps_error_t why;
  embps_error_clear(&why);
  if (wait_ready(fd, POLLOUT, deadline, "connecting", &why) != EMBPS_OK ||
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &len) != 0 || so_error != 0) {
    embps_error_set(err, EMBPS_UNAVAILABLE, "cannot connect to %s at 127.0.0.1:%u: %s", what, port,
                    why.message[0] ? why.message : strerror(so_error ? so_error : errno));
    close(fd);
    return -1;
  }
  return fd;
}

/* Accepts one connection within the deadline; -1 with err set. */
static int accept_one(int listener, uint64_t deadline, const char *what, embps_error_t *err) {
  for (;;) {
    int fd;
    if (wait_ready(listener, POLLIN, deadline, what, err) != EMBPS_OK)
      return -1;
    fd = accept4(listener, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0)
      return fd;
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED) {
      embps_error_set(err, EMBPS_UNAVAILABLE, "accept failed %s: %s", what, strerror(errno));
      return -1;
    }
  }
}

/* ---- the id --------------------------------------------------------------------------------- */

static void pack_id(uint8_t out[EMBPS_NCCL_UNIQUE_ID_BYTES], const id_fields_t *f) {
  memset(out, 0, EMBPS_NCCL_UNIQUE_ID_BYTES);
  memcpy(out, ID_MAGIC, ID_MAGIC_BYTES);
  out[8] = (uint8_t)(f->port & 0xff);
  out[9] = (uint8_t)(f->port >> 8);
  for (int i = 0; i < 4; i++)
    out[12 + i] = (uint8_t)(f->pid >> (8 * i));
  memcpy(out + 16, f->nonce, NONCE_BYTES);
}

static int unpack_id(const uint8_t in[EMBPS_NCCL_UNIQUE_ID_BYTES], id_fields_t *f) {
  if (memcmp(in, ID_MAGIC, ID_MAGIC_BYTES) != 0)
    return -1;
  f->port = (uint16_t)(in[8] | in[9] << 8);
  f->pid = 0;
  for (int i = 0; i < 4; i++)
    f->pid |= (uint32_t)in[12 + i] << (8 * i);
  memcpy(f->nonce, in + 16, NONCE_BYTES);
  return f->port ? 0 : -1;
}

embps_status_t embps_comm_nccl_unique_id(uint8_t out[EMBPS_NCCL_UNIQUE_ID_BYTES],
                                         embps_error_t *err) {
  id_fields_t f;
  int fd, slot = -1;
  if (!out)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "embps_comm_nccl_unique_id: no output");
  memset(&f, 0, sizeof(f));
  if (getrandom(f.nonce, sizeof(f.nonce), 0) != (ssize_t)sizeof(f.nonce))
    return embps_error_set(err, EMBPS_UNAVAILABLE, "simulated NCCL: getrandom: %s",
                           strerror(errno));
  if ((fd = open_listener(&f.port, err)) < 0) {
    EMBPS_ERROR("%s", err ? err->message : "simulated NCCL: cannot open the root's listener");
    return EMBPS_UNAVAILABLE;
  }
  f.pid = (uint32_t)getpid();
  pthread_mutex_lock(&roots_mu);
  if (roots_used == 0)
    for (int i = 0; i < MAX_ROOTS; i++)
      roots[i].fd = -1;
  roots_used = 1;
  for (int i = 0; i < MAX_ROOTS && slot < 0; i++)
    if (roots[i].fd < 0)
      slot = i;
  if (slot >= 0) {
    roots[slot].fd = fd;
    memcpy(roots[slot].nonce, f.nonce, NONCE_BYTES);
  }
  pthread_mutex_unlock(&roots_mu);
  if (slot < 0) {
    close(fd);
    return embps_error_set(err, EMBPS_UNAVAILABLE,
                           "simulated NCCL: %d unique ids are waiting for their rank 0 already",
                           MAX_ROOTS);
  }
  pack_id(out, &f);
  return EMBPS_OK;
}

/* The root's listener for the id's nonce, taken out of the table; -1 when this process made no
 * such id or a rank 0 took it already. */
static int take_root(const uint8_t nonce[NONCE_BYTES]) {
  int fd = -1;
  pthread_mutex_lock(&roots_mu);
  for (int i = 0; i < MAX_ROOTS && roots_used && fd < 0; i++)
    if (roots[i].fd >= 0 && memcmp(roots[i].nonce, nonce, NONCE_BYTES) == 0) {
      fd = roots[i].fd;
      roots[i].fd = -1;
    }
  pthread_mutex_unlock(&roots_mu);
  return fd;
}

/* ---- rendezvous ----------------------------------------------------------------------------- */

/* Rank 0: takes size-1 hellos on the root's listener into fds[r] (the data connection to rank
 * r), checks the devices, and sends every rank the verdict and the port table. */
static embps_status_t run_root(int root, uint32_t size, const id_fields_t *id, const hello_t *mine,
                               int *fds, uint64_t deadline, uint64_t timeout_ms,
                               embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  hello_t *hellos = embps_calloc(size, sizeof(*hellos));
  uint16_t *ports = embps_calloc(size, sizeof(*ports));
  verdict_t v;
  uint32_t joined = 0;

  memset(&v, 0, sizeof(v));
  if (!hellos || !ports) {
    ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "simulated NCCL: out of memory");
    goto exit;
  }
  hellos[0] = *mine;
  while (joined < size - 1) {
    embps_error_t why;
    hello_t h;
    int fd;
    embps_error_clear(&why);
    if ((fd = accept_one(root, deadline, "waiting for ranks to join", &why)) < 0) {
      char missing[200];
      size_t len = 0;
      missing[0] = '\0';
      for (uint32_t r = 1; r < size && len < sizeof(missing) - 16; r++)
        if (fds[r] < 0)
          len += (size_t)snprintf(missing + len, sizeof(missing) - len, "%s%u", len ? ", " : "", r);
      ret = embps_error_set(err, EMBPS_UNAVAILABLE,
                            "simulated NCCL: rank(s) %s of %u did not join within %llu ms (%s)",
                            missing, size, (unsigned long long)timeout_ms, why.message);
      goto exit;
    }
    if (recv_exact(fd, &h, sizeof(h), deadline, "reading a rank's hello", &why) != EMBPS_OK ||
        memcmp(h.magic, ID_MAGIC, ID_MAGIC_BYTES) != 0 ||
        memcmp(h.nonce, id->nonce, NONCE_BYTES) != 0) {
      EMBPS_WARN("simulated NCCL root: dropped a connection that is not a rank of this id%s%s",
                 why.message[0] ? ": " : "", why.message);
      close(fd);
      continue;
    }
    if (h.size != size || h.rank == 0 || h.rank >= size || fds[h.rank] >= 0) {
      close(fd);
      ret = embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                            "simulated NCCL: a rank joined as rank %u of %u, but this is rank 0 "
                            "of %u%s",
                            h.rank, h.size, size,
                            h.rank && h.rank < size && fds[h.rank] >= 0 ? " and that rank joined"
                                                                        : "");
      goto exit;
    }
    h.bus_id[BUS_ID_BYTES - 1] = '\0';
    hellos[h.rank] = h;
    ports[h.rank] = h.port;
    fds[h.rank] = fd;
    joined++;
  }
  /* NCCL refuses a communicator with two ranks on one GPU; so does the simulator. */
  for (uint32_t a = 0; a < size && !v.status; a++)
    for (uint32_t b = a + 1; b < size && !v.status; b++)
      if (strcmp(hellos[a].bus_id, hellos[b].bus_id) == 0) {
        v.status = EMBPS_INTERNAL;
        snprintf(v.message, sizeof(v.message),
                 "simulated NCCL: ranks %u and %u are both on CUDA device %d (PCI %.32s): NCCL "
                 "refuses a duplicate GPU",
                 a, b, (int)hellos[a].device, hellos[a].bus_id);
      }
  for (uint32_t r = 1; r < size; r++) {
    embps_error_t why;
    embps_error_clear(&why);
    if (send_exact(fds[r], &v, sizeof(v), deadline, "sending the verdict", &why) != EMBPS_OK ||
        (!v.status && send_exact(fds[r], ports, size * sizeof(*ports), deadline,
                                 "sending the port table", &why) != EMBPS_OK)) {
      ret = embps_error_set(err, EMBPS_UNAVAILABLE, "simulated NCCL: rank %u: %s", r, why.message);
      goto exit;
    }
  }
  if (v.status)
    ret = embps_error_set(err, (embps_status_t)v.status, "%s", v.message);
exit:
  embps_free(hellos);
  embps_free(ports);
  return ret;
}

/* Rank r > 0: joins through the root, then completes the mesh (see the file comment). */
static embps_status_t join(uint32_t rank, uint32_t size, const id_fields_t *id, hello_t *mine,
                           int *fds, uint64_t deadline, uint64_t timeout_ms, embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  uint16_t *ports = embps_calloc(size, sizeof(*ports));
  int listener = -1;
  verdict_t v;
  embps_error_t why;
  char what[96];

  embps_error_clear(&why);
  if (!ports) {
    ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "simulated NCCL: out of memory");
    goto exit;
  }
  if ((listener = open_listener(&mine->port, err)) < 0) {
    ret = EMBPS_UNAVAILABLE;
    goto exit;
  }
  if ((fds[0] = connect_loopback(id->port, deadline, "the root (rank 0)", &why)) < 0 ||
      send_exact(fds[0], mine, sizeof(*mine), deadline, "sending the hello to rank 0", &why) !=
          EMBPS_OK) {
    ret = embps_error_set(err, EMBPS_UNAVAILABLE,
                          "simulated NCCL: rank %u cannot join through the root of process %u "
                          "(is its unique id stale?): %s",
                          rank, id->pid, why.message);
    goto exit;
  }
  if (recv_exact(fds[0], &v, sizeof(v), deadline,
                 "waiting for the root (rank 0) to hear from every rank", &why) != EMBPS_OK) {
    ret = embps_error_set(err, EMBPS_UNAVAILABLE, "simulated NCCL: rank %u: %s (within %llu ms)",
                          rank, why.message, (unsigned long long)timeout_ms);
    goto exit;
  }
  v.message[sizeof(v.message) - 1] = '\0';
  if (v.status != EMBPS_OK) {
    ret = embps_error_set(err, (embps_status_t)v.status, "%s", v.message);
    goto exit;
  }
  if (recv_exact(fds[0], ports, size * sizeof(*ports), deadline, "reading the port table", &why) !=
      EMBPS_OK) {
    ret = embps_error_set(err, EMBPS_UNAVAILABLE, "simulated NCCL: rank %u: %s", rank, why.message);
    goto exit;
  }
  for (uint32_t j = 1; j < rank; j++) {
    peer_hello_t ph;
    memset(&ph, 0, sizeof(ph));
    memcpy(ph.magic, ID_MAGIC, ID_MAGIC_BYTES);
    memcpy(ph.nonce, id->nonce, NONCE_BYTES);
    ph.rank = rank;
    snprintf(what, sizeof(what), "rank %u", j);
    if ((fds[j] = connect_loopback(ports[j], deadline, what, &why)) < 0 ||
        send_exact(fds[j], &ph, sizeof(ph), deadline, "sending a peer hello", &why) != EMBPS_OK) {
      ret =
          embps_error_set(err, EMBPS_UNAVAILABLE, "simulated NCCL: rank %u: %s", rank, why.message);
      goto exit;
    }
  }
  for (uint32_t accepted = 0; accepted < size - 1 - rank;) {
    peer_hello_t ph;
    int fd = accept_one(listener, deadline, "waiting for higher ranks to connect", &why);
    if (fd < 0) {
      ret =
          embps_error_set(err, EMBPS_UNAVAILABLE, "simulated NCCL: rank %u: %s", rank, why.message);
      goto exit;
    }
    if (recv_exact(fd, &ph, sizeof(ph), deadline, "reading a peer hello", &why) != EMBPS_OK ||
        memcmp(ph.magic, ID_MAGIC, ID_MAGIC_BYTES) != 0 ||
        memcmp(ph.nonce, id->nonce, NONCE_BYTES) != 0 || ph.rank <= rank || ph.rank >= size ||
        fds[ph.rank] >= 0) {
      EMBPS_WARN("simulated NCCL rank %u: dropped a connection that is not a higher rank of this "
                 "id%s%s",
                 rank, why.message[0] ? ": " : "", why.message);
      embps_error_clear(&why);
      close(fd);
      continue;
    }
    fds[ph.rank] = fd;
    accepted++;
  }
exit:
  if (listener >= 0)
    close(listener);
  embps_free(ports);
  return ret;
}

/* ---- the collectives on device buffers ------------------------------------------------------- */

/* Makes the communicator's device current and waits for the engine's stream, then opens the
 * device's memory to this thread's host code. */
static embps_status_t enter(sim_comm_t *s, const char *what, embps_error_t *err) {
  int current = -1;
  cudaError_t e = cudaGetDevice(&current);
  if (e == cudaSuccess && current != s->device)
    e = cudaSetDevice(s->device);
  if (e == cudaSuccess)
    e = cudaStreamSynchronize(s->stream);
  if (e != cudaSuccess)
    return embps_error_set(err, EMBPS_INTERNAL, "%s: CUDA: %s", what, cudaGetErrorString(e));
  sim_cuda_device_access_begin(s->device);
  return EMBPS_OK;
}

static embps_status_t leave(sim_comm_t *s, embps_status_t status) {
  sim_cuda_device_access_end(s->device);
  return status;
}

static embps_status_t sim_all_gather(embps_comm_t *c, const void *send, size_t bytes, void *recv,
                                     embps_error_t *err) {
  sim_comm_t *s = (sim_comm_t *)c;
  embps_status_t ret;
  sim_cuda_check_device(s->stream, send, bytes, "nccl all_gather: send");
  sim_cuda_check_device(s->stream, recv, bytes * c->size, "nccl all_gather: recv");
  if ((ret = enter(s, "all_gather", err)) != EMBPS_OK)
    return ret;
  return leave(s, embps_comm_all_gather(s->tcp, send, bytes, recv, err));
}

static embps_status_t sim_all_to_all(embps_comm_t *c, const void *send, size_t bytes, void *recv,
                                     embps_error_t *err) {
  sim_comm_t *s = (sim_comm_t *)c;
  embps_status_t ret;
  sim_cuda_check_device(s->stream, send, bytes * c->size, "nccl all_to_all: send");
  sim_cuda_check_device(s->stream, recv, bytes * c->size, "nccl all_to_all: recv");
  if ((ret = enter(s, "all_to_all", err)) != EMBPS_OK)
    return ret;
  return leave(s, embps_comm_all_to_all(s->tcp, send, bytes, recv, err));
}

static embps_status_t sim_all_reduce(embps_comm_t *c, void *buf, size_t count,
                                     embps_comm_type_t type, embps_comm_op_t op,
                                     embps_error_t *err) {
  sim_comm_t *s = (sim_comm_t *)c;
  embps_status_t ret;
  sim_cuda_check_device(s->stream, buf, count * embps_comm_type_size(type), "nccl all_reduce: buf");
  if ((ret = enter(s, "all_reduce", err)) != EMBPS_OK)
    return ret;
  return leave(s, embps_comm_all_reduce(s->tcp, buf, count, type, op, err));
}

static embps_status_t sim_barrier(embps_comm_t *c, embps_error_t *err) {
  sim_comm_t *s = (sim_comm_t *)c;
  embps_status_t ret;
  if ((ret = enter(s, "barrier", err)) != EMBPS_OK)
    return ret;
  return leave(s, embps_comm_barrier(s->tcp, err));
}

static void sim_destroy(embps_comm_t *c) {
  sim_comm_t *s = (sim_comm_t *)c;
  embps_comm_free(s->tcp);
  embps_free(s);
}

static const embps_comm_ops_t sim_ops = {
    .name = "nccl",
    .all_gather = sim_all_gather,
    .all_to_all = sim_all_to_all,
    .all_reduce = sim_all_reduce,
    .barrier = sim_barrier,
    .destroy = sim_destroy,
};

embps_comm_t *sim_nccl_wrap(embps_comm_t *tcp, cudaStream_t stream, int device) {
  sim_comm_t *s = embps_calloc(1, sizeof(*s));
  if (!s) {
    embps_comm_free(tcp);
    return NULL;
  }
  s->base.ops = &sim_ops;
  s->base.rank = tcp->rank;
  s->base.size = tcp->size;
  s->tcp = tcp;
  s->stream = stream;
  s->device = device;
  return &s->base;
}

embps_status_t embps_comm_nccl_new(embps_comm_t **out, uint32_t rank, uint32_t size,
                                   const uint8_t unique_id[EMBPS_NCCL_UNIQUE_ID_BYTES],
                                   void *stream, uint64_t timeout_ms, embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  uint64_t create_ms = timeout_ms ? timeout_ms : UNBOUNDED_CREATE_MS;
  uint64_t deadline = now_ms() + create_ms;
  sim_comm_t *s = NULL;
  embps_comm_t *tcp = NULL;
  int *fds = NULL, root = -1;
  id_fields_t id;
  hello_t mine;
  cudaError_t e;

  if (!out || !unique_id || size == 0 || rank >= size || size > MAX_RANKS) {
    EMBPS_ERROR("embps_comm_nccl_new: bad arguments (rank %u, size %u)", rank, size);
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "embps_comm_nccl_new: bad arguments (rank %u, size %u%s%s)", rank, size,
                           out ? "" : ", no output", unique_id ? "" : ", no unique id");
  }
  if (unpack_id(unique_id, &id) != 0)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "embps_comm_nccl_new: not a unique id from the simulator's "
                           "embps_comm_nccl_unique_id");
  memset(&mine, 0, sizeof(mine));
  memcpy(mine.magic, ID_MAGIC, ID_MAGIC_BYTES);
  memcpy(mine.nonce, id.nonce, NONCE_BYTES);
  mine.rank = rank;
  mine.size = size;
  if ((e = cudaGetDevice(&mine.device)) != cudaSuccess ||
      (e = cudaDeviceGetPCIBusId(mine.bus_id, BUS_ID_BYTES, mine.device)) != cudaSuccess ||
      (e = cudaStreamSynchronize((cudaStream_t)stream)) != cudaSuccess) {
    EMBPS_ERROR("embps_comm_nccl_new: %s", cudaGetErrorString(e));
    return embps_error_set(err, EMBPS_INTERNAL, "embps_comm_nccl_new: CUDA: %s",
                           cudaGetErrorString(e));
  }
  if (rank == 0 && (root = take_root(id.nonce)) < 0)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "simulated NCCL: rank 0 must create its communicator once, in the "
                           "process that made the unique id (pid %u), which keeps the root's "
                           "socket",
                           id.pid);
  if (!(fds = embps_malloc(size * sizeof(*fds)))) {
    ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "embps_comm_nccl_new: out of memory");
    goto fail;
  }
  for (uint32_t r = 0; r < size; r++)
    fds[r] = -1;
  if (rank == 0)
    ret = run_root(root, size, &id, &mine, fds, deadline, create_ms, err);
  else
    ret = join(rank, size, &id, &mine, fds, deadline, create_ms, err);
  if (ret == EMBPS_UNAVAILABLE)
    EMBPS_ERROR("embps_comm_nccl_new: rank %u of %u did not join the group (did every rank start "
                "with the same unique id within %llu ms?): %s",
                rank, size, (unsigned long long)create_ms, err ? err->message : "");
  else if (ret != EMBPS_OK)
    EMBPS_ERROR("embps_comm_nccl_new: rank %u of %u: %s", rank, size, err ? err->message : "");
  if (ret != EMBPS_OK)
    goto fail;
  ret = embps_comm_tcp_new(&tcp, rank, size, fds, timeout_ms);
  for (uint32_t r = 0; r < size; r++)
    fds[r] = -1; /* the TCP communicator owns them now, or closed them */
  if (ret != EMBPS_OK) {
    embps_error_set(err, ret, "simulated NCCL: cannot create the TCP communicator");
    goto fail;
  }
  if (!(s = (sim_comm_t *)sim_nccl_wrap(tcp, (cudaStream_t)stream, mine.device))) {
    ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "embps_comm_nccl_new: out of memory");
    goto fail;
  }
  EMBPS_INFO("comm nccl rank %u/%u on device %d: ready (simulated: the TCP backend over loopback)",
             rank, size, mine.device);
  *out = &s->base;
  ret = EMBPS_OK;
exit:
  if (root >= 0)
    close(root);
  embps_free(fds);
  return ret;
fail:
  if (fds)
    for (uint32_t r = 0; r < size; r++)
      if (fds[r] >= 0)
        close(fds[r]);
  goto exit;
}
