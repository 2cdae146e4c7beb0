/* The sender's native stream reader: token streams' sockets read in C, polled on a timer instead of woken
 * per delta, each read stamped by the kernel (engine/native.py drives it; benchmarks/RESULTS.md, "A
 * native reader").
 *
 * Python hands over a connection whose response head it parsed (200, chunked transfer encoding; the body
 * at a chunk-size boundary) with the body bytes it already read. `poll()` then, with the GIL released,
 * drains every ready socket (epoll, non-blocking recvmsg until a short read), de-chunks the body, splits
 * the server-sent events, and reads each event's running `"completion_tokens":N` without a JSON parse,
 * as completions.usage_tokens does in Python. An event that needs Python (an error, vLLM's speculative
 * metrics, no count to read, any shape but one data line) is handed back whole and uncounted, so the
 * parse in Python gives exactly what the Python path gives; with it go the tokens counted before it
 * and the running count after them, so the deltas reach Python in their order and Python counts from
 * the running count as it keeps it (a count only Python's parse could read is never counted twice). A stream ends at its zero-size chunk and the empty line after it;
 * it is then out of the reader and its connection is Python's again.
 *
 * Stamps: the kernel's receive time of the read that carried an event (SO_TIMESTAMPNS, CLOCK_REALTIME),
 * moved onto CLOCK_MONOTONIC (Python's time.monotonic) by the two clocks' offset at the read, so a read
 * that waits for the next poll keeps its arrival time. A read that merged several segments carries the
 * last one's stamp: an event read together with a later one is stamped with the later one's arrival
 * (`merged` counts them; the Python path stamps every event when its read is handled, later still).
 * Stamps of a stream never go backwards and never pass the read.
 *
 * Streams are keyed by their socket's fd (unique among those held). One thread: a call while `poll` runs
 * without the GIL is refused. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define READ_BUF (64 * 1024)
#define MAX_EVENTS 512
#define MAX_LINE 256              /* a chunk-size line, extensions included */
#define MAX_EVENT (16 << 20)      /* an event never ended (no blank line): the answer is malformed */
#define MAX_CHUNK (1LL << 40)

enum { S_SIZE, S_DATA, S_DATA_CR, S_DATA_LF, S_TRAILER, S_DONE };
/* How a stream ended (the `end` of its tuple). */
enum { E_RUNNING = 0, E_DONE = 1, E_DONE_EXTRA = 2, E_MALFORMED = -1, E_CLOSED = -2, E_READ = -3 };

typedef struct {
    double stamp;
    long long seen;
    size_t off, len;
    long long tokens, events; /* counted in C since the last handed event, before this one */
    double first, last;
} Handed;

typedef struct {
    long long key;
    int fd;
    int state;
    long long left;      /* bytes of the current chunk still to come */
    char line[MAX_LINE]; /* a chunk-size line split over reads (its extensions not kept) */
    int line_len;
    int in_ext;          /* past the size line's ';': what follows is skipped */
    int trailer_len;     /* bytes of the current trailer line (only whether it is empty matters) */
    char *ev;            /* the de-chunked body not yet split into events */
    size_t ev_len, ev_cap;
    long long seen;      /* completion tokens so far */
    long long tokens;    /* new since the last report */
    long long events;    /* events with new tokens since the last report */
    double first, last;  /* stamps of this report's first and last such event (first < 0: none) */
    double floor;        /* the latest stamp given: stamps never go backwards */
    char *hb;            /* handed-back events' bytes since the last report */
    size_t hb_len, hb_cap;
    Handed *hand;
    size_t n_hand, cap_hand;
    double reported_at;  /* when its tokens were last reported (< 0: never) */
    size_t slot;         /* its index in the reader's `all` */
    int end;
    const char *why;     /* the end's reason when it is an error */
    int err_no;
    int moved;
    int in_read;         /* events with new tokens in the read being fed */
} Stream;

typedef struct {
    PyObject_HEAD int epfd;
    double report_s; /* a stream's tokens are reported at most this often (its first at once) */
    Stream **by_fd;
    size_t n_fd;
    Stream **all;    /* the streams held, densely: each poll looks for tokens due for a report */
    size_t cap_all;
    Stream **moved;
    size_t n_moved, cap_moved;
    Py_ssize_t held;
    long long counted; /* events with new tokens, all streams */
    long long merged;  /* of them, those read together with a later one (stamped with its arrival) */
    long long unstamped; /* reads the kernel gave no receive stamp (stamped when read) */
    int busy; /* poll() is reading without the GIL: calls from another thread are refused */
    int ready; /* initialised: epfd is the reader's */
} Reader;

static int refuse_if_busy(Reader *r) {
    if (r->busy) {
        PyErr_SetString(PyExc_RuntimeError, "the reader is polling in another thread");
        return -1;
    }
    return 0;
}

static double clock_s(clockid_t id) {
    struct timespec ts;
    clock_gettime(id, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int grow(void **p, size_t *cap, size_t need, size_t item) {
    if (need <= *cap) return 0;
    size_t cap2 = *cap ? *cap : 16;
    while (cap2 < need) cap2 *= 2;
    void *q = realloc(*p, cap2 * item);
    if (!q) return -1;
    *p = q;
    *cap = cap2;
    return 0;
}

static void fail(Stream *s, int end, const char *why) {
    if (s->end == E_RUNNING) {
        s->end = end;
        s->why = why;
    }
}

static const char KEY[] = "\"completion_tokens\":";
static const char ERROR_KEY[] = "\"error\"";
static const char SPEC_KEY[] = "\"speculative_decoding\"";

static const char *last_of(const char *p, size_t n, const char *needle, size_t m) {
    const char *hit = NULL;
    const char *at = p;
    size_t left = n;
    for (;;) {
        const char *h = memmem(at, left, needle, m);
        if (!h) return hit;
        hit = h;
        left -= (size_t)(h + 1 - at);
        at = h + 1;
    }
}

static int is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

/* Whether the event has a `data:` line at all (one without is a comment or a keep-alive). */
static int has_data(const char *p, size_t n) {
    if (n >= 5 && memcmp(p, "data:", 5) == 0) return 1;
    return memmem(p, n, "\ndata:", 6) != NULL || memmem(p, n, "\rdata:", 6) != NULL;
}

/* Whether the event is one `data:` line and nothing else (its blank line aside): what vLLM sends, and
 * the only shape read here; any other goes to Python's parse. */
static int one_data_line(const char *p, size_t n) {
    if (n < 5 || memcmp(p, "data:", 5) != 0) return 0;
    const char *nl = memchr(p, '\n', n);
    const char *cr = memchr(p, '\r', n);
    const char *end = nl && (!cr || cr > nl) ? nl : cr;
    /* The line ends where the blank line starts: only \r and \n from there on. */
    for (const char *q = end; q && q < p + n; q++)
        if (*q != '\r' && *q != '\n') return 0;
    return end != NULL;
}

/* Whether the event is exactly one data line whose payload, stripped, is [DONE]. */
static int is_done_marker(const char *p, size_t n) {
    if (!one_data_line(p, n)) return 0;
    const char *a = p + 5, *b = p + n;
    while (a < b && is_space(*a)) a++;
    while (b > a && is_space(b[-1])) b--;
    return b - a == 6 && memcmp(a, "[DONE]", 6) == 0;
}

static int hand_back(Stream *s, const char *p, size_t n, double stamp) {
    if (grow((void **)&s->hb, &s->hb_cap, s->hb_len + n, 1) < 0) return -1;
    if (grow((void **)&s->hand, &s->cap_hand, s->n_hand + 1, sizeof(Handed)) < 0) return -1;
    memcpy(s->hb + s->hb_len, p, n);
    /* The tokens counted before it go with it, so Python takes the stream's deltas in their order. */
    s->hand[s->n_hand++] = (Handed){stamp, s->seen, s->hb_len, n, s->tokens, s->events, s->first, s->last};
    s->hb_len += n;
    s->tokens = s->events = 0;
    s->first = s->last = -1.0;
    return 0;
}

/* The running count of a one-line data event, read as completions.usage_tokens reads it: the last
 * `"completion_tokens":` and the digits after it (1 and *total set), else 0. */
static int read_count(const char *p, size_t n, long long *total) {
    const char *hit = last_of(p, n, KEY, sizeof(KEY) - 1);
    if (!hit) return 0;
    const char *d = hit + sizeof(KEY) - 1, *stop = p + n;
    while (d < stop && is_space(*d)) d++;
    long long t = 0;
    int digits = 0;
    while (d < stop && *d >= '0' && *d <= '9' && digits < 18) {
        t = t * 10 + (*d - '0');
        d++;
        digits++;
    }
    if (!digits || (d < stop && *d >= '0' && *d <= '9')) return 0;
    *total = t;
    return 1;
}

/* One event (its bytes, the blank line after it included). Counted here when it is one data line with a
 * count to read and neither an error nor speculative metrics. Every other event with data goes to Python,
 * whose parse counts it (an error's count never: the request fails first); the running count here still
 * follows one it can read, so the next events are counted from where Python's parse left it. */
static int on_event(Stream *s, const char *p, size_t n, double stamp) {
    if (!has_data(p, n) || is_done_marker(p, n)) return 0;
    long long total = 0;
    int readable = one_data_line(p, n) && read_count(p, n, &total);
    int special = memmem(p, n, ERROR_KEY, sizeof(ERROR_KEY) - 1) || memmem(p, n, SPEC_KEY, sizeof(SPEC_KEY) - 1);
    if (readable && !special) {
        if (total > s->seen) {
            s->in_read++;
            s->tokens += total - s->seen;
            s->seen = total;
            s->events += 1;
            if (s->first < 0) s->first = stamp;
            s->last = stamp;
        }
        return 0;
    }
    if (hand_back(s, p, n, stamp) < 0) return -1;
    if (readable && total > s->seen) s->seen = total;
    return 0;
}

/* Split the buffered body into events at blank lines (\r?\n\r?\n, as sse.py does). */
static int split_events(Stream *s, double stamp) {
    size_t start = 0, i = 0;
    char *ev = s->ev;
    while (i < s->ev_len) {
        char *nl = memchr(ev + i, '\n', s->ev_len - i);
        if (!nl) break;
        size_t j = (size_t)(nl - ev) + 1;
        size_t stop = 0;
        if (j < s->ev_len && ev[j] == '\n') {
            stop = j + 1;
        } else if (j + 1 < s->ev_len && ev[j] == '\r' && ev[j + 1] == '\n') {
            stop = j + 2;
        } else if (j >= s->ev_len || (ev[j] == '\r' && j + 1 >= s->ev_len)) {
            break; /* the blank line may still be coming */
        }
        if (stop) {
            if (on_event(s, ev + start, stop - start, stamp) < 0) return -1;
            start = i = stop;
        } else {
            i = j;
        }
    }
    if (start) {
        memmove(ev, ev + start, s->ev_len - start);
        s->ev_len -= start;
    }
    if (s->ev_len > MAX_EVENT) fail(s, E_MALFORMED, "a stream event without end");
    return 0;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* A chunk-size line (without its CRLF): hex digits, optional extensions after ';'. */
static long long chunk_size(const char *line, int len) {
    int i = 0;
    while (i < len && (line[i] == ' ' || line[i] == '\t')) i++;
    long long size = 0;
    int digits = 0;
    for (; i < len && hexval(line[i]) >= 0; i++, digits++) {
        size = size * 16 + hexval(line[i]);
        if (size > MAX_CHUNK) return -1;
    }
    while (i < len && (line[i] == ' ' || line[i] == '\t')) i++;
    if (!digits || (i < len && line[i] != ';')) return -1;
    return size;
}

/* De-chunk `n` bytes of the body and split what is whole into events. */
static void feed(Stream *s, const char *p, size_t n, double stamp) {
    size_t i = 0;
    s->in_read = 0;
    while (i < n && s->state != S_DONE && s->end == E_RUNNING) {
        char c = p[i];
        switch (s->state) {
        case S_SIZE:
            if (c == '\n') {
                if (!s->line_len || s->line[s->line_len - 1] != '\r') {
                    fail(s, E_MALFORMED, "malformed chunk size");
                    break;
                }
                long long size = chunk_size(s->line, s->line_len - 1);
                s->line_len = 0;
                s->in_ext = 0;
                if (size < 0) {
                    fail(s, E_MALFORMED, "malformed chunk size");
                } else if (size == 0) {
                    s->state = S_TRAILER;
                    s->trailer_len = 0;
                } else {
                    s->left = size;
                    s->state = S_DATA;
                }
            } else if (s->in_ext && c != '\r') {
                /* an extension's byte: skipped */
            } else if (s->line_len >= MAX_LINE) {
                fail(s, E_MALFORMED, "chunk size line too long");
            } else {
                s->line[s->line_len++] = c;
                s->in_ext = c == ';';
            }
            i++;
            break;
        case S_DATA: {
            size_t take = n - i < (size_t)s->left ? n - i : (size_t)s->left;
            if (grow((void **)&s->ev, &s->ev_cap, s->ev_len + take, 1) < 0) {
                fail(s, E_READ, "out of memory");
                break;
            }
            memcpy(s->ev + s->ev_len, p + i, take);
            s->ev_len += take;
            i += take;
            s->left -= (long long)take;
            if (s->left == 0) s->state = S_DATA_CR;
            break;
        }
        case S_DATA_CR:
        case S_DATA_LF:
            if (c != (s->state == S_DATA_CR ? '\r' : '\n')) {
                fail(s, E_MALFORMED, "malformed chunk");
                break;
            }
            s->state = s->state == S_DATA_CR ? S_DATA_LF : S_SIZE;
            i++;
            break;
        case S_TRAILER:
            /* Lines until an empty one (CRLF alone); what they say is not needed. */
            if (c == '\n') {
                if (s->trailer_len <= 1) s->state = S_DONE;
                s->trailer_len = 0;
            } else {
                s->trailer_len += s->trailer_len < 2 ? 1 : 0;
                if (c != '\r') s->trailer_len = 2;
            }
            i++;
            break;
        }
    }
    /* What is whole is read also when the framing broke after it (the request fails either way, as on
     * the Python path, with what came before it counted). */
    if ((s->end == E_RUNNING || s->end == E_MALFORMED) && split_events(s, stamp) < 0)
        fail(s, E_READ, "out of memory");
    if (s->end == E_RUNNING && s->state == S_DONE) {
        /* An unended last event is dropped, as the Python path's splitter drops it. */
        s->ev_len = 0;
        s->end = i < n ? E_DONE_EXTRA : E_DONE;
    }
}

static int mark(Reader *r, Stream *s) {
    if (!s->moved) {
        if (grow((void **)&r->moved, &r->cap_moved, r->n_moved + 1, sizeof(Stream *)) < 0) return -1;
        s->moved = 1;
        r->moved[r->n_moved++] = s;
    }
    /* Ended: out of epoll now (a closed socket would stay ready and spin `poll`). */
    if (s->end != E_RUNNING) epoll_ctl(r->epfd, EPOLL_CTL_DEL, s->fd, NULL);
    return 0;
}

/* Whether the stream has news for Python now: an end, an event to parse, or tokens whose report is due
 * (the first at once, then at most every report_s: the deltas between add up here, their first and last
 * stamps and their number kept, so what Python learns is the same, in fewer calls). */
static int changed(Reader *r, Stream *s, double now) {
    if (s->n_hand || s->end != E_RUNNING) return 1;
    return s->tokens && (s->reported_at < 0 || now - s->reported_at >= r->report_s);
}

/* Read one ready socket until a short read (GIL released). */
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
                s->err_no = errno;
                fail(s, E_READ, "read failed");
            }
        } else if (got == 0) {
            fail(s, E_CLOSED, "connection closed by the server");
        } else {
            double mono = clock_s(CLOCK_MONOTONIC);
            double stamp = -1.0;
            for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
                if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_TIMESTAMPNS) {
                    struct timespec ts;
                    memcpy(&ts, CMSG_DATA(c), sizeof(ts));
                    double real = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
                    stamp = real - (clock_s(CLOCK_REALTIME) - mono);
                }
            }
            if (stamp < 0) {
                /* The kernel turns receive stamps on a moment after the first socket asks (a deferred
                 * switch): a read before that is stamped now, as the Python path stamps every read. */
                r->unstamped++;
                stamp = mono;
            }
            if (stamp > mono) stamp = mono;
            if (stamp < s->floor) stamp = s->floor;
            s->floor = stamp;
            feed(s, buf, (size_t)got, stamp);
            r->counted += s->in_read;
            r->merged += s->in_read > 1 ? s->in_read - 1 : 0;
        }
        if (changed(r, s, clock_s(CLOCK_MONOTONIC)) && mark(r, s) < 0) {
            fail(s, E_READ, "out of memory");
            return;
        }
        if (got <= 0 || s->end != E_RUNNING || (size_t)got < READ_BUF) return;
    }
}

static void forget(Reader *r, Stream *s) {
    epoll_ctl(r->epfd, EPOLL_CTL_DEL, s->fd, NULL);
    r->by_fd[s->fd] = NULL;
    r->held--;
    r->all[s->slot] = r->all[r->held];
    r->all[s->slot]->slot = s->slot;
    free(s->ev);
    free(s->hb);
    free(s->hand);
    free(s);
}

static PyObject *handed_list(Stream *s) {
    if (!s->n_hand) Py_RETURN_NONE;
    PyObject *list = PyList_New((Py_ssize_t)s->n_hand);
    if (!list) return NULL;
    for (size_t k = 0; k < s->n_hand; k++) {
        Handed *h = &s->hand[k];
        PyObject *t = Py_BuildValue("(dLy#LLdd)", h->stamp, h->seen, s->hb + h->off, (Py_ssize_t)h->len,
                                    h->tokens, h->events, h->first, h->last);
        if (!t) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)k, t);
    }
    return list;
}

static PyObject *end_reason(Stream *s) {
    if (s->end >= 0) Py_RETURN_NONE;
    if (s->end == E_READ && s->err_no) return PyUnicode_FromFormat("%s: %s", s->why, strerror(s->err_no));
    return PyUnicode_FromString(s->why ? s->why : "failed");
}

static int refuse_if_unready(Reader *r) {
    if (!r->ready) {
        PyErr_SetString(PyExc_RuntimeError, "the reader is not initialised");
        return -1;
    }
    return refuse_if_busy(r);
}

static PyObject *Reader_poll(Reader *r, PyObject *Py_UNUSED(ignored)) {
    struct epoll_event events[MAX_EVENTS];
    if (refuse_if_unready(r) < 0) return NULL;
    char *buf = PyMem_RawMalloc(READ_BUF);
    if (!buf) return PyErr_NoMemory();
    /* Streams already marked (an `add` whose first bytes moved them) stay in the list. */
    double now = 0.0;
    r->busy = 1;
    Py_BEGIN_ALLOW_THREADS;
    for (;;) {
        int n = epoll_wait(r->epfd, events, MAX_EVENTS, 0);
        if (n <= 0) break;
        for (int k = 0; k < n; k++) {
            Stream *s = events[k].data.ptr;
            if (s->end == E_RUNNING) drain(r, s, buf);
        }
        if (n < MAX_EVENTS) break;
    }
    /* Tokens read in earlier polls whose report has come due with no read since. */
    now = clock_s(CLOCK_MONOTONIC);
    for (Py_ssize_t k = 0; k < r->held; k++) {
        Stream *s = r->all[k];
        if (!s->moved && changed(r, s, now) && mark(r, s) < 0) fail(s, E_READ, "out of memory");
    }
    Py_END_ALLOW_THREADS;
    r->busy = 0;
    PyMem_RawFree(buf);
    /* Every tuple built before any stream is reset or freed: a failure leaves them all for next time. */
    PyObject *out = PyList_New((Py_ssize_t)r->n_moved);
    if (!out) return NULL;
    for (size_t k = 0; k < r->n_moved; k++) {
        Stream *s = r->moved[k];
        PyObject *handed = handed_list(s);
        PyObject *why = handed ? end_reason(s) : NULL;
        if (!why) {
            Py_XDECREF(handed);
            Py_DECREF(out);
            return NULL;
        }
        /* "N" hands both references over, on failure too. */
        PyObject *t = Py_BuildValue("(LLLddiNNL)", s->key, s->tokens, s->events, s->first, s->last, s->end,
                                    handed, why, s->seen);
        if (!t) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)k, t);
    }
    for (size_t k = 0; k < r->n_moved; k++) {
        Stream *s = r->moved[k];
        if (s->tokens) s->reported_at = now;
        s->tokens = s->events = 0;
        s->first = s->last = -1.0;
        s->n_hand = s->hb_len = 0;
        s->moved = 0;
        if (s->end != E_RUNNING) forget(r, s);
    }
    r->n_moved = 0;
    return out;
}

static PyObject *Reader_add(Reader *r, PyObject *args) {
    int fd;
    long long key;
    Py_buffer initial;
    if (refuse_if_unready(r) < 0) return NULL;
    if (!PyArg_ParseTuple(args, "iLy*", &fd, &key, &initial)) return NULL;
    if (fd < 0 || ((size_t)fd < r->n_fd && r->by_fd[fd])) {
        PyBuffer_Release(&initial);
        PyErr_SetString(PyExc_ValueError, "bad or busy fd");
        return NULL;
    }
    if ((size_t)fd >= r->n_fd) {
        size_t n = r->n_fd ? r->n_fd : 1024;
        while (n <= (size_t)fd) n *= 2;
        Stream **grown = realloc(r->by_fd, n * sizeof(Stream *));
        if (!grown) {
            PyBuffer_Release(&initial);
            return PyErr_NoMemory();
        }
        memset(grown + r->n_fd, 0, (n - r->n_fd) * sizeof(Stream *));
        r->by_fd = grown;
        r->n_fd = n;
    }
    Stream *s = calloc(1, sizeof(Stream));
    if (!s || grow((void **)&r->all, &r->cap_all, (size_t)r->held + 1, sizeof(Stream *)) < 0) {
        free(s);
        PyBuffer_Release(&initial);
        return PyErr_NoMemory();
    }
    s->fd = fd;
    s->key = key;
    s->state = S_SIZE;
    s->first = s->last = -1.0;
    s->reported_at = -1.0;
    int on = 1;
    if (setsockopt(fd, SOL_SOCKET, SO_TIMESTAMPNS, &on, sizeof(on)) < 0 && errno == EBADF) {
        PyBuffer_Release(&initial);
        free(s);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    /* In epoll before any mark: a stream on the moved list is always one the reader holds. */
    struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP, .data.ptr = s};
    if (epoll_ctl(r->epfd, EPOLL_CTL_ADD, fd, &ev) < 0) {
        PyBuffer_Release(&initial);
        free(s);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    r->by_fd[fd] = s;
    s->slot = (size_t)r->held;
    r->all[r->held++] = s;
    s->floor = clock_s(CLOCK_MONOTONIC);
    if (initial.len) {
        feed(s, initial.buf, (size_t)initial.len, s->floor);
        r->counted += s->in_read;
        r->merged += s->in_read > 1 ? s->in_read - 1 : 0;
    }
    PyBuffer_Release(&initial);
    if (changed(r, s, s->floor) && mark(r, s) < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *Reader_remove(Reader *r, PyObject *args) {
    int fd;
    if (refuse_if_busy(r) < 0) return NULL;
    if (!PyArg_ParseTuple(args, "i", &fd)) return NULL;
    if (fd >= 0 && (size_t)fd < r->n_fd && r->by_fd[fd]) {
        Stream *s = r->by_fd[fd];
        if (s->moved) { /* reported next poll otherwise: out of the list */
            for (size_t k = 0; k < r->n_moved; k++)
                if (r->moved[k] == s) {
                    r->moved[k] = r->moved[--r->n_moved];
                    break;
                }
        }
        forget(r, s);
        Py_RETURN_TRUE;
    }
    Py_RETURN_FALSE;
}

static Py_ssize_t Reader_len(Reader *r) { return r->held; }

static int Reader_init(Reader *r, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"report_s", NULL};
    double report_s = 0.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|d", kwlist, &report_s)) return -1;
    if (report_s < 0) {
        PyErr_SetString(PyExc_ValueError, "report_s must be >= 0");
        return -1;
    }
    if (r->ready) {
        PyErr_SetString(PyExc_RuntimeError, "already initialised");
        return -1;
    }
    r->epfd = epoll_create1(EPOLL_CLOEXEC);
    if (r->epfd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    r->report_s = report_s;
    r->ready = 1;
    return 0;
}

static void Reader_dealloc(Reader *r) {
    for (size_t fd = 0; fd < r->n_fd; fd++)
        if (r->by_fd[fd]) forget(r, r->by_fd[fd]);
    free(r->by_fd);
    free(r->all);
    free(r->moved);
    if (r->ready) close(r->epfd);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyMemberDef Reader_members[] = {
    {"counted", T_LONGLONG, offsetof(Reader, counted), READONLY, "events with new tokens read so far"},
    {"merged", T_LONGLONG, offsetof(Reader, merged), READONLY,
     "of them, those read in one read with a later one: stamped with the later one's arrival"},
    {"unstamped", T_LONGLONG, offsetof(Reader, unstamped), READONLY,
     "reads without the kernel's receive stamp (stamped when read)"},
    {NULL, 0, 0, 0, NULL},
};

static PySequenceMethods Reader_as_sequence = {.sq_length = (lenfunc)Reader_len};

static PyMethodDef Reader_methods[] = {
    {"add", (PyCFunction)Reader_add, METH_VARARGS,
     "add(fd, key, body_bytes): read this socket's chunked event stream from here on"},
    {"remove", (PyCFunction)Reader_remove, METH_VARARGS,
     "remove(fd) -> bool: forget a stream (an aborted request) before its socket closes"},
    {"poll", (PyCFunction)Reader_poll, METH_NOARGS,
     "poll() -> [(key, tokens, events, first, last, end, handed, why, seen)] for each stream that moved; "
     "handed: None or [(stamp, seen, event_bytes, tokens, events, first, last)], the tokens counted "
     "before each handed event and the running count after them; the tuple's own tokens: those counted "
     "after the last, seen: the running count after them"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "soakd.engine._reader.Reader",
    .tp_basicsize = sizeof(Reader),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Token streams read in C, polled on a timer (engine/native.py).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Reader_init,
    .tp_dealloc = (destructor)Reader_dealloc,
    .tp_methods = Reader_methods,
    .tp_members = Reader_members,
    .tp_as_sequence = &Reader_as_sequence,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "soakd.engine._reader", .m_size = -1,
};

PyMODINIT_FUNC PyInit__reader(void) {
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
