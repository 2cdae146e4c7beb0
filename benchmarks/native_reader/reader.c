/* A prototype of the native stream reader (issue: CPU per output token): the token streams' sockets read
 * in C, polled on a timer instead of woken per delta, each read stamped by the kernel.
 *
 * Python hands over a connection whose response head it has parsed (chunked transfer encoding, the body
 * at a chunk-size boundary), with the body bytes it already read. `poll()` then, with the GIL released,
 * drains every ready socket (epoll, non-blocking recvmsg until EAGAIN), de-chunks the body, splits the
 * SSE events, reads each event's running `"completion_tokens":N` without a JSON parse, and returns one
 * tuple per stream that moved: (key, new tokens, events with tokens, first stamp, last stamp, done,
 * error). A stream is done at its zero-size chunk; it is then out of the reader and its connection is
 * Python's again (keep-alive). Stamps are the kernel's receive time of the read that carried the event
 * (SO_TIMESTAMPNS, CLOCK_REALTIME ns), so a read that waits for the next poll does not move them.
 *
 * A benchmark prototype, not soakd's reader: no TLS, no token ids, no speculative metrics, no error
 * event parsing (an event without a count is not counted), events split on "\n\n" only (vLLM's), one
 * thread (a call while `poll` runs without the GIL raises). A read that merged several segments carries
 * the last one's stamp. Built by bench_native_reader.py. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_FD 65536
#define READ_BUF (64 * 1024)
#define MAX_EVENTS 512

enum { S_SIZE, S_DATA, S_DATA_END, S_TRAILER, S_DONE };

typedef struct {
    long long key;
    int fd;
    int state;
    long long left;      /* bytes of the current chunk still to come */
    char line[256];      /* a chunk-size or trailer line split over reads */
    int line_len;
    char *ev;            /* the de-chunked body not yet split into events */
    size_t ev_len, ev_cap;
    long long seen;      /* completion tokens so far */
    long long tokens;    /* new since the last report */
    long long events;    /* events with tokens since the last report */
    long long first_ns, last_ns;
    int done, error, moved;
} Stream;

typedef struct {
    PyObject_HEAD int epfd;
    Stream **by_fd;
    Stream **moved;
    int n_moved;
    int busy; /* poll() is reading without the GIL: add/remove/poll from another thread refused */
} Reader;

static int refuse_if_busy(Reader *r) {
    if (r->busy) {
        PyErr_SetString(PyExc_RuntimeError, "the reader is polling in another thread");
        return -1;
    }
    return 0;
}

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int ev_append(Stream *s, const char *p, size_t n) {
    if (s->ev_len + n > s->ev_cap) {
        size_t cap = s->ev_cap ? s->ev_cap : 1024;
        while (cap < s->ev_len + n) cap *= 2;
        char *grown = realloc(s->ev, cap);
        if (!grown) return -1;
        s->ev = grown;
        s->ev_cap = cap;
    }
    memcpy(s->ev + s->ev_len, p, n);
    s->ev_len += n;
    return 0;
}

static const char KEY[] = "\"completion_tokens\":";

/* Split the buffered body into events ("...\n\n"); count each event's new tokens. */
static void split_events(Stream *s, long long stamp) {
    size_t start = 0;
    for (;;) {
        char *end = memmem(s->ev + start, s->ev_len - start, "\n\n", 2);
        if (!end) break;
        size_t len = (size_t)(end - (s->ev + start));
        const char *hit = memmem(s->ev + start, len, KEY, sizeof(KEY) - 1);
        if (hit) {
            const char *d = hit + sizeof(KEY) - 1;
            const char *stop = s->ev + start + len;
            while (d < stop && *d == ' ') d++;
            long long total = 0;
            int digits = 0;
            while (d < stop && *d >= '0' && *d <= '9') {
                total = total * 10 + (*d - '0');
                d++;
                digits++;
            }
            if (digits && total > s->seen) {
                s->tokens += total - s->seen;
                s->seen = total;
                s->events += 1;
                if (!s->first_ns) s->first_ns = stamp;
                s->last_ns = stamp;
            }
        }
        start += len + 2;
    }
    if (start) {
        memmove(s->ev, s->ev + start, s->ev_len - start);
        s->ev_len -= start;
    }
}

/* De-chunk `n` bytes of the body; -1 on malformed input. */
static int feed(Stream *s, const char *p, size_t n, long long stamp) {
    size_t i = 0;
    while (i < n && s->state != S_DONE) {
        if (s->state == S_SIZE || s->state == S_TRAILER) {
            /* A line: the chunk size, or the (empty) line after the last chunk. */
            while (i < n && p[i] != '\n') {
                if (s->line_len >= (int)sizeof(s->line) - 1) return -1;
                s->line[s->line_len++] = p[i++];
            }
            if (i == n) break;
            i++; /* the '\n' */
            s->line[s->line_len] = 0;
            if (s->line_len && s->line[s->line_len - 1] == '\r') s->line[--s->line_len] = 0;
            if (s->state == S_TRAILER) {
                if (s->line_len == 0) s->state = S_DONE;
                s->line_len = 0;
                continue;
            }
            char *endp;
            long long size = strtoll(s->line, &endp, 16);
            if (endp == s->line || size < 0) return -1;
            s->line_len = 0;
            if (size == 0) {
                s->state = S_TRAILER;
            } else {
                s->left = size;
                s->state = S_DATA;
            }
        } else if (s->state == S_DATA) {
            size_t take = n - i < (size_t)s->left ? n - i : (size_t)s->left;
            if (ev_append(s, p + i, take) < 0) return -1;
            i += take;
            s->left -= (long long)take;
            if (s->left == 0) s->state = S_DATA_END;
        } else if (s->state == S_DATA_END) {
            /* "\r\n" after a chunk's data */
            if (p[i] == '\r') {
                i++;
                continue;
            }
            if (p[i] != '\n') return -1;
            i++;
            s->state = S_SIZE;
        }
    }
    split_events(s, stamp);
    return 0;
}

static void mark(Reader *r, Stream *s) {
    if (!s->moved) {
        s->moved = 1;
        r->moved[r->n_moved++] = s;
    }
    /* Finished or failed: out of epoll now (a closed socket would stay ready and spin `poll`). */
    if (s->error || s->state == S_DONE) epoll_ctl(r->epfd, EPOLL_CTL_DEL, s->fd, NULL);
}

/* Read one ready socket until EAGAIN (GIL released). */
static void drain(Reader *r, Stream *s, char *buf) {
    char control[256];
    for (;;) {
        struct iovec iov = {buf, READ_BUF};
        struct msghdr msg = {0};
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control;
        msg.msg_controllen = sizeof(control);
        ssize_t got = recvmsg(s->fd, &msg, MSG_DONTWAIT);
        if (got < 0) {
            if (errno == EINTR) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) {
                s->error = 1;
                mark(r, s);
            }
            return;
        }
        if (got == 0) { /* closed by the server mid-stream */
            s->error = 1;
            mark(r, s);
            return;
        }
        long long stamp = 0;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
            if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_TIMESTAMPNS) {
                struct timespec ts;
                memcpy(&ts, CMSG_DATA(c), sizeof(ts));
                stamp = (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
            }
        }
        if (!stamp) stamp = now_ns();
        if (feed(s, buf, (size_t)got, stamp) < 0) s->error = 1;
        if (s->tokens || s->error || s->state == S_DONE) mark(r, s);
        if (s->error || s->state == S_DONE) return;
        if ((size_t)got < READ_BUF) return; /* drained: no second recv for EAGAIN */
    }
}

static void forget(Reader *r, Stream *s) {
    epoll_ctl(r->epfd, EPOLL_CTL_DEL, s->fd, NULL);
    r->by_fd[s->fd] = NULL;
    free(s->ev);
    free(s);
}

static PyObject *Reader_poll(Reader *r, PyObject *Py_UNUSED(ignored)) {
    struct epoll_event events[MAX_EVENTS];
    if (refuse_if_busy(r) < 0) return NULL;
    char *buf = PyMem_RawMalloc(READ_BUF);
    if (!buf) return PyErr_NoMemory();
    /* Streams already marked (an `add` whose first bytes held tokens) stay in the list. */
    r->busy = 1;
    Py_BEGIN_ALLOW_THREADS;
    for (;;) {
        int n = epoll_wait(r->epfd, events, MAX_EVENTS, 0);
        if (n <= 0) break;
        for (int k = 0; k < n; k++) {
            Stream *s = events[k].data.ptr;
            if (s->state != S_DONE && !s->error) drain(r, s, buf);
        }
        if (n < MAX_EVENTS) break;
    }
    Py_END_ALLOW_THREADS;
    r->busy = 0;
    PyMem_RawFree(buf);
    /* Every tuple built before any stream is reset or freed: a failure leaves them all for next time. */
    PyObject *out = PyList_New(r->n_moved);
    if (!out) return NULL;
    for (int k = 0; k < r->n_moved; k++) {
        Stream *s = r->moved[k];
        PyObject *t = Py_BuildValue("(LLLLLii)", s->key, s->tokens, s->events, s->first_ns, s->last_ns,
                                    s->state == S_DONE, s->error);
        if (!t) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, k, t);
    }
    for (int k = 0; k < r->n_moved; k++) {
        Stream *s = r->moved[k];
        s->tokens = s->events = 0;
        s->first_ns = 0;
        s->moved = 0;
        if (s->state == S_DONE || s->error) forget(r, s);
    }
    r->n_moved = 0;
    return out;
}

static PyObject *Reader_add(Reader *r, PyObject *args) {
    int fd;
    long long key;
    Py_buffer initial;
    if (refuse_if_busy(r) < 0) return NULL;
    if (!PyArg_ParseTuple(args, "iLy*", &fd, &key, &initial)) return NULL;
    if (fd < 0 || fd >= MAX_FD || r->by_fd[fd]) {
        PyBuffer_Release(&initial);
        PyErr_SetString(PyExc_ValueError, "bad or busy fd");
        return NULL;
    }
    Stream *s = calloc(1, sizeof(Stream));
    if (!s) {
        PyBuffer_Release(&initial);
        return PyErr_NoMemory();
    }
    s->fd = fd;
    s->key = key;
    s->state = S_SIZE;
    int on = 1;
    setsockopt(fd, SOL_SOCKET, SO_TIMESTAMPNS, &on, sizeof(on));
    /* In epoll before any mark: a stream on the moved list is always one the reader holds. */
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = s};
    if (epoll_ctl(r->epfd, EPOLL_CTL_ADD, fd, &ev) < 0) {
        PyBuffer_Release(&initial);
        free(s);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    r->by_fd[fd] = s;
    if (initial.len) {
        if (feed(s, initial.buf, (size_t)initial.len, now_ns()) < 0) s->error = 1;
        if (s->tokens || s->error || s->state == S_DONE) mark(r, s);
    }
    PyBuffer_Release(&initial);
    Py_RETURN_NONE;
}

static PyObject *Reader_remove(Reader *r, PyObject *args) {
    int fd;
    if (refuse_if_busy(r) < 0) return NULL;
    if (!PyArg_ParseTuple(args, "i", &fd)) return NULL;
    if (fd >= 0 && fd < MAX_FD && r->by_fd[fd]) {
        Stream *s = r->by_fd[fd];
        if (s->moved) { /* reported next poll otherwise: take it out of the list */
            for (int k = 0; k < r->n_moved; k++)
                if (r->moved[k] == s) r->moved[k] = r->moved[--r->n_moved];
        }
        forget(r, s);
    }
    Py_RETURN_NONE;
}

static int Reader_init(Reader *r, PyObject *Py_UNUSED(args), PyObject *Py_UNUSED(kw)) {
    if (r->moved) {
        PyErr_SetString(PyExc_RuntimeError, "already initialised");
        return -1;
    }
    r->epfd = epoll_create1(EPOLL_CLOEXEC);
    if (r->epfd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    r->by_fd = calloc(MAX_FD, sizeof(Stream *));
    r->moved = calloc(MAX_FD, sizeof(Stream *));
    if (!r->by_fd || !r->moved) {
        free(r->by_fd);
        free(r->moved);
        r->by_fd = r->moved = NULL;
        close(r->epfd);
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void Reader_dealloc(Reader *r) {
    if (r->by_fd) {
        for (int fd = 0; fd < MAX_FD; fd++)
            if (r->by_fd[fd]) forget(r, r->by_fd[fd]);
        free(r->by_fd);
    }
    if (r->moved) close(r->epfd); /* only an initialised reader holds an epoll fd */
    free(r->moved);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyMethodDef Reader_methods[] = {
    {"add", (PyCFunction)Reader_add, METH_VARARGS, "add(fd, key, initial_body_bytes)"},
    {"remove", (PyCFunction)Reader_remove, METH_VARARGS, "remove(fd): forget a stream (aborted)"},
    {"poll", (PyCFunction)Reader_poll, METH_NOARGS,
     "poll() -> [(key, tokens, events, first_ns, last_ns, done, error)]"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "native_reader.Reader",
    .tp_basicsize = sizeof(Reader),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Reader_init,
    .tp_dealloc = (destructor)Reader_dealloc,
    .tp_methods = Reader_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "native_reader", .m_size = -1,
};

PyMODINIT_FUNC PyInit_native_reader(void) {
    if (PyType_Ready(&ReaderType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&ReaderType);
    if (PyModule_AddObject(m, "Reader", (PyObject *)&ReaderType) < 0) {
        Py_DECREF(&ReaderType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
