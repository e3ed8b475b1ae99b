/* The receiving half of kvstore/net/wire.py's ReplyReader, in C, with the GIL released.
 *
 * One call reads one bulk-string reply (GET / GETRANGE / GETDEL) from a plain TCP or Unix
 * socket: its first line out of the reader's scratch buffer (receiving more as needed), then its
 * bytes straight into the caller's buffer with recv, then its CRLF. While it waits and copies
 * the interpreter is free: the other threads' reads, the checksums of values already landed and
 * the engine's own Python run meanwhile. The rules are wire.py's, to the byte: the same reply
 * types, the same limits (a line at most max_line; a reply longer than its destination drained
 * up to drain_max, refused past it), the same deadline (the socket timeout bounds each wait, the
 * reply as a whole its budget plus its length at min_bytes_per_s). Errors are returned as codes
 * and wire.py raises its own exceptions for them, so both paths fail alike.
 *
 * read_bulk(fd, scratch, start, end, dest, limit, drain_max, recv_timeout_s, deadline_at,
 *           min_bytes_per_s, max_line[, deadline_cap]) -> (kind, value, start, end, deadline_at)
 *   scratch: the reader's writable scratch buffer; its unread bytes are scratch[start:end].
 *   dest: a writable buffer for the value, or None to read the header only (read_bulk_new:
 *         the caller allocates exactly the length, then calls read_body).
 *   deadline_at: time.monotonic() seconds; returned extended by the reply's length, never past
 *         deadline_cap (the batch's deadline: the caller's; none by default).
 *   kind: BULK (value: its length, landed in dest), NIL, OVERSIZE (value: its length; drained),
 *         HEADER (value: its length; its bytes are next), ERROR_REPLY (value: the line after
 *         '-', bytes), or a failure: TIMEOUT_RECV, TIMEOUT_DEADLINE, CLOSED, OS_ERROR (value:
 *         errno), INVALID (value: the offending line's first bytes), TOO_LONG_LINE,
 *         NO_CRLF, TOO_LARGE (value: the length). A Python signal handler that raises while
 *         the read waits (Ctrl-C) ends it with that exception, as Python's socket calls do.
 *
 * read_body(fd, scratch, start, end, dest, recv_timeout_s, deadline_at)
 *   -> (kind, value, start, end, deadline_at): fills dest exactly, then reads the CRLF.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>

enum {
    K_BULK = 0,
    K_NIL = 1,
    K_OVERSIZE = 2,
    K_HEADER = 3,
    K_ERROR_REPLY = 4,
    K_TIMEOUT_RECV = -1,
    K_TIMEOUT_DEADLINE = -2,
    K_CLOSED = -3,
    K_OS_ERROR = -4,
    K_INVALID = -5,
    K_TOO_LONG_LINE = -6,
    K_NO_CRLF = -7,
    K_TOO_LARGE = -8,
    K_SIGNALLED = -9, /* a signal handler raised: the exception is set */
};

typedef struct {
    int fd;
    char *buf;
    Py_ssize_t cap, start, end;
    double recv_timeout; /* < 0: none */
    double deadline;     /* monotonic seconds */
    int err;             /* errno of K_OS_ERROR */
} Reader;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Pending Python signals (Ctrl-C) are handled while a read waits, as Python's own socket
 * calls handle them: a handler that raises ends the read (K_SIGNALLED, the exception set). */
static int signalled(void) {
    PyGILState_STATE gil = PyGILState_Ensure();
    int raised = PyErr_CheckSignals() < 0;
    PyGILState_Release(gil);
    return raised;
}

/* The longest single poll (ms): a longer wait polls again (a timeout of weeks must not
 * overflow an int of milliseconds). */
#define MAX_POLL_MS 3600000

/* Receive up to len bytes into p (at least one), waiting by the rules above: each receive
 * within the socket timeout, the reply within its deadline. Returns the count received, or a
 * failure kind (negative). */
static Py_ssize_t recv_some(Reader *r, char *p, Py_ssize_t len) {
    double recv_until = -1; /* when this receive's timeout ends (set at its first wait) */
    /* none past the deadline, even of bytes already there (as wire.py's before_io) */
    if (now_s() >= r->deadline)
        return K_TIMEOUT_DEADLINE;
    for (;;) {
        ssize_t n = recv(r->fd, p, (size_t)len, MSG_DONTWAIT);
        if (n > 0)
            return (Py_ssize_t)n;
        if (n == 0)
            return K_CLOSED;
        if (errno == EINTR) {
            if (signalled())
                return K_SIGNALLED;
            continue;
        }
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            r->err = errno;
            return K_OS_ERROR;
        }
        double now = now_s();
        if (recv_until < 0 && r->recv_timeout >= 0)
            recv_until = now + r->recv_timeout;
        int by_deadline = 1;
        double until = r->deadline;
        if (recv_until >= 0 && recv_until < until) {
            until = recv_until;
            by_deadline = 0;
        }
        double left = until - now;
        if (left <= 0)
            return by_deadline ? K_TIMEOUT_DEADLINE : K_TIMEOUT_RECV;
        double ms_wanted = left * 1000.0;
        int ms = ms_wanted > MAX_POLL_MS ? MAX_POLL_MS : (int)ms_wanted;
        if (ms <= 0)
            ms = 1; /* (a sub-millisecond wait still waits) */
        struct pollfd pfd = {r->fd, POLLIN, 0};
        int ready = poll(&pfd, 1, ms);
        if (ready < 0) {
            if (errno != EINTR) {
                r->err = errno;
                return K_OS_ERROR;
            }
            if (signalled())
                return K_SIGNALLED;
        }
        /* (ready == 0: the time left is checked at the top, after one more receive) */
    }
}

/* Receive more into the scratch buffer, moving the unread bytes to its front first. */
static Py_ssize_t fill(Reader *r) {
    Py_ssize_t unread = r->end - r->start;
    if (r->start) {
        memmove(r->buf, r->buf + r->start, (size_t)unread);
        r->start = 0;
        r->end = unread;
    }
    if (r->end >= r->cap)
        return K_TOO_LONG_LINE;
    Py_ssize_t n = recv_some(r, r->buf + r->end, r->cap - r->end);
    if (n < 0)
        return n;
    r->end += n;
    return 0;
}

/* The next line (without its CRLF) as [*line, *line + *len) inside the scratch buffer. */
static Py_ssize_t read_line(Reader *r, Py_ssize_t max_line, const char **line, Py_ssize_t *len) {
    Py_ssize_t scanned = 0; /* bytes after start already searched (a fill keeps them in order) */
    for (;;) {
        const char *from = r->buf + r->start + scanned;
        Py_ssize_t n = r->end - r->start - scanned;
        const char *cr = n > 1 ? memchr(from, '\r', (size_t)(n - 1)) : NULL;
        while (cr != NULL && cr[1] != '\n') {
            Py_ssize_t rest = (r->buf + r->end - 1) - (cr + 1);
            cr = rest > 0 ? memchr(cr + 1, '\r', (size_t)rest) : NULL;
        }
        if (cr != NULL) {
            *line = r->buf + r->start;
            *len = cr - *line;
            r->start = (cr - r->buf) + 2;
            return 0;
        }
        if (r->end - r->start > max_line)
            return K_TOO_LONG_LINE;
        scanned = r->end - r->start > 0 ? r->end - r->start - 1 : 0;
        Py_ssize_t got = fill(r);
        if (got < 0)
            return got;
    }
}

/* Fill dest[0:len) exactly: what is buffered first, the rest straight from the socket. */
static Py_ssize_t take(Reader *r, char *dest, Py_ssize_t len) {
    Py_ssize_t have = r->end - r->start;
    if (have > len)
        have = len;
    memcpy(dest, r->buf + r->start, (size_t)have);
    r->start += have;
    Py_ssize_t pos = have;
    while (pos < len) {
        Py_ssize_t n = recv_some(r, dest + pos, len - pos);
        if (n < 0)
            return n;
        pos += n;
    }
    return 0;
}

static Py_ssize_t skip(Reader *r, Py_ssize_t n) {
    while (n) {
        if (r->start == r->end) {
            r->start = r->end = 0;
            Py_ssize_t got = fill(r);
            if (got < 0)
                return got;
        }
        Py_ssize_t step = r->end - r->start;
        if (step > n)
            step = n;
        r->start += step;
        n -= step;
    }
    return 0;
}

static Py_ssize_t crlf(Reader *r) {
    while (r->end - r->start < 2) {
        Py_ssize_t got = fill(r);
        if (got < 0)
            return got;
    }
    if (r->buf[r->start] != '\r' || r->buf[r->start + 1] != '\n')
        return K_NO_CRLF;
    r->start += 2;
    return 0;
}

/* A bulk length: an optional '-' (a nil) and 1 to 18 digits; anything else is invalid (wire.py's
 * Python path applies the same rule: no spaces, '+' or '_' that Python's int() would take). */
static int parse_length(const char *p, Py_ssize_t n, long long *out) {
    int neg = 0;
    if (n > 0 && p[0] == '-') {
        neg = 1;
        p++;
        n--;
    }
    if (n <= 0 || n > 18)
        return -1;
    long long v = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (p[i] < '0' || p[i] > '9')
            return -1;
        v = v * 10 + (p[i] - '0');
    }
    *out = neg ? -v : v;
    return 0;
}

static PyObject *result(int kind, PyObject *value, Reader *r) {
    if (value == NULL)
        return NULL;
    return Py_BuildValue("(iNnnd)", kind, value, r->start, r->end, r->deadline);
}

static PyObject *failure(int kind, Reader *r, const char *line, Py_ssize_t len) {
    if (kind == K_OS_ERROR)
        return result(kind, PyLong_FromLong(r->err), r);
    if (line != NULL)
        return result(kind, PyBytes_FromStringAndSize(line, len > 40 ? 40 : len), r);
    return result(kind, PyLong_FromLong(0), r);
}

static void release_buffers(Py_buffer *scratch, Py_buffer *dest, int have_dest) {
    PyBuffer_Release(scratch);
    if (have_dest)
        PyBuffer_Release(dest);
}

/* The scratch buffer and (unless dest_obj is None) the destination, writable and contiguous,
 * with start/end checked against the scratch; on failure nothing is held and an error is set. */
static int get_buffers(PyObject *scratch_obj, PyObject *dest_obj, Py_ssize_t start,
                       Py_ssize_t end, Py_buffer *scratch, Py_buffer *dest, int *have_dest) {
    if (PyObject_GetBuffer(scratch_obj, scratch, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    *have_dest = dest_obj != Py_None;
    if (*have_dest &&
        PyObject_GetBuffer(dest_obj, dest, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(scratch);
        return -1;
    }
    if (start < 0 || end < start || end > scratch->len) {
        release_buffers(scratch, dest, *have_dest);
        PyErr_SetString(PyExc_ValueError, "scratch offsets out of range");
        return -1;
    }
    return 0;
}

static PyObject *read_bulk(PyObject *self, PyObject *args) {
    int fd;
    PyObject *scratch_obj, *dest_obj;
    Py_ssize_t start, end, limit, drain_max, max_line;
    double recv_timeout, deadline, min_rate, cap = Py_HUGE_VAL;
    (void)self;
    if (!PyArg_ParseTuple(args, "iOnnOnnddd" "n|d", &fd, &scratch_obj, &start, &end, &dest_obj,
                          &limit, &drain_max, &recv_timeout, &deadline, &min_rate, &max_line,
                          &cap))
        return NULL;
    if (deadline > cap)
        deadline = cap;
    Py_buffer scratch, dest;
    int have_dest;
    if (get_buffers(scratch_obj, dest_obj, start, end, &scratch, &dest, &have_dest) < 0)
        return NULL;
    if (have_dest && limit > dest.len)
        limit = dest.len;
    Reader r = {fd, (char *)scratch.buf, scratch.len, start, end, recv_timeout, deadline, 0};
    int kind = K_BULK;
    long long length = 0;
    Py_ssize_t status = 0;
    const char *line = NULL;
    Py_ssize_t line_len = 0;
    Py_BEGIN_ALLOW_THREADS;
    status = read_line(&r, max_line, &line, &line_len);
    if (status < 0) {
        kind = (int)status;
        line = NULL;
    } else if (line_len >= 1 && line[0] == '$') {
        if (parse_length(line + 1, line_len - 1, &length) < 0) {
            kind = K_INVALID;
        } else if (length < 0) {
            kind = K_NIL;
        } else {
            r.deadline += (double)(length + 2) / min_rate;
            if (r.deadline > cap)
                r.deadline = cap;
            if (length > limit) {
                if (length > drain_max) {
                    kind = K_TOO_LARGE;
                } else {
                    status = skip(&r, (Py_ssize_t)length + 2);
                    kind = status < 0 ? (int)status : K_OVERSIZE;
                }
            } else if (!have_dest) {
                kind = K_HEADER;
            } else {
                status = take(&r, (char *)dest.buf, (Py_ssize_t)length);
                if (status == 0)
                    status = crlf(&r);
                kind = status < 0 ? (int)status : K_BULK;
            }
        }
    } else if (line_len == 1 && line[0] == '_') {
        kind = K_NIL;
    } else if (line_len >= 1 && line[0] == '-') {
        kind = K_ERROR_REPLY;
    } else {
        kind = K_INVALID;
    }
    Py_END_ALLOW_THREADS;
    PyObject *out;
    /* (the line still lies in the scratch buffer, unless a later fill moved it: only the kinds
     * that stop right after the line refer to it) */
    if (kind == K_SIGNALLED)
        out = NULL; /* the handler's exception, raised (the stream's place is lost) */
    else if (kind == K_ERROR_REPLY)
        out = result(kind, PyBytes_FromStringAndSize(line + 1, line_len - 1), &r);
    else if (kind == K_INVALID)
        out = failure(kind, &r, line, line_len);
    else if (kind == K_TOO_LARGE)
        out = result(kind, PyLong_FromLongLong(length), &r);
    else if (kind < 0)
        out = failure(kind, &r, NULL, 0);
    else if (kind == K_NIL)
        out = result(kind, PyLong_FromLong(0), &r);
    else
        out = result(kind, PyLong_FromLongLong(length), &r);
    release_buffers(&scratch, &dest, have_dest);
    return out;
}

static PyObject *read_body(PyObject *self, PyObject *args) {
    int fd;
    PyObject *scratch_obj, *dest_obj;
    Py_ssize_t start, end;
    double recv_timeout, deadline;
    (void)self;
    if (!PyArg_ParseTuple(args, "iOnnOdd", &fd, &scratch_obj, &start, &end, &dest_obj,
                          &recv_timeout, &deadline))
        return NULL;
    if (dest_obj == Py_None) {
        PyErr_SetString(PyExc_TypeError, "read_body needs a destination");
        return NULL;
    }
    Py_buffer scratch, dest;
    int have_dest;
    if (get_buffers(scratch_obj, dest_obj, start, end, &scratch, &dest, &have_dest) < 0)
        return NULL;
    Reader r = {fd, (char *)scratch.buf, scratch.len, start, end, recv_timeout, deadline, 0};
    Py_ssize_t status;
    Py_BEGIN_ALLOW_THREADS;
    status = take(&r, (char *)dest.buf, dest.len);
    if (status == 0)
        status = crlf(&r);
    Py_END_ALLOW_THREADS;
    PyObject *out = status == K_SIGNALLED ? NULL
                    : status < 0          ? failure((int)status, &r, NULL, 0)
                                          : result(K_BULK, PyLong_FromSsize_t(dest.len), &r);
    release_buffers(&scratch, &dest, have_dest);
    return out;
}

static PyMethodDef methods[] = {
    {"read_bulk", read_bulk, METH_VARARGS, "Read one bulk-string reply (see the module)."},
    {"read_body", read_body, METH_VARARGS, "Read a bulk string's bytes and CRLF."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_wire_core",
    .m_doc = "kvstore's bulk-reply receiver in C, the GIL released (see kvstore/net/wire.py).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__wire_core(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    /* wire.py's WIRE_CORE_VERSION: bumped whenever the arguments change (2: deadline_cap) */
    PyModule_AddIntConstant(m, "VERSION", 2);
    PyModule_AddIntConstant(m, "BULK", K_BULK);
    PyModule_AddIntConstant(m, "NIL", K_NIL);
    PyModule_AddIntConstant(m, "OVERSIZE", K_OVERSIZE);
    PyModule_AddIntConstant(m, "HEADER", K_HEADER);
    PyModule_AddIntConstant(m, "ERROR_REPLY", K_ERROR_REPLY);
    PyModule_AddIntConstant(m, "TIMEOUT_RECV", K_TIMEOUT_RECV);
    PyModule_AddIntConstant(m, "TIMEOUT_DEADLINE", K_TIMEOUT_DEADLINE);
    PyModule_AddIntConstant(m, "CLOSED", K_CLOSED);
    PyModule_AddIntConstant(m, "OS_ERROR", K_OS_ERROR);
    PyModule_AddIntConstant(m, "INVALID", K_INVALID);
    PyModule_AddIntConstant(m, "TOO_LONG_LINE", K_TOO_LONG_LINE);
    PyModule_AddIntConstant(m, "NO_CRLF", K_NO_CRLF);
    PyModule_AddIntConstant(m, "TOO_LARGE", K_TOO_LARGE);
    return m;
}
