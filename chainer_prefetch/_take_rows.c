/*
 * chainer_prefetch._take_rows: variable-length rows gathered in one call.
 *
 * take_rows(sources, source_of_row, starts, ends, rows, width)
 *     -> (offsets, values)
 *
 * The compiled form of chainer_prefetch.columnar.take_rows_python (see
 * StoredRows there): stored row r is the values starts[r] to ends[r] (in
 * elements of `width` bytes) of source source_of_row[r] (of source 0 when
 * source_of_row is None).  Returns the rows `rows`, in that order, joined:
 * `offsets` holds len(rows) + 1 int64 positions (in elements) and `values`
 * the rows' bytes, both as bytearrays.
 *
 * Every position is checked before anything is copied; a bad one raises
 * IndexError (a row out of range) or ValueError (a stored row out of its
 * source), naming the row.  The GIL is held throughout: copying a batch's
 * rows takes tens of microseconds, less than taking the GIL back would
 * cost while other threads run Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* A contiguous one-dimensional buffer of native int64 (`name` for the
 * message); its length in *count. */
static int
int64_buffer(PyObject *obj, Py_buffer *view, const char *name, Py_ssize_t *count)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return -1;
    }
    const char *format = view->format;
    int native = format != NULL
        && (strcmp(format, "l") == 0 || strcmp(format, "q") == 0
            || strcmp(format, "=l") == 0 || strcmp(format, "=q") == 0
#if PY_LITTLE_ENDIAN
            || strcmp(format, "<l") == 0 || strcmp(format, "<q") == 0
#else
            || strcmp(format, ">l") == 0 || strcmp(format, ">q") == 0
#endif
            );
    if (!native || view->itemsize != 8 || view->ndim != 1) {
        PyErr_Format(PyExc_TypeError,
                     "%s must be a one-dimensional array of native int64", name);
        PyBuffer_Release(view);
        return -1;
    }
    *count = view->len / 8;
    return 0;
}

/* Element i of an int64 buffer (which may not be aligned). */
static inline int64_t
at(const Py_buffer *view, Py_ssize_t i)
{
    int64_t value;
    memcpy(&value, (const char *)view->buf + i * 8, sizeof value);
    return value;
}

static PyObject *
take_rows(PyObject *self, PyObject *args)
{
    PyObject *sources_arg, *source_of_row_obj, *starts_obj, *ends_obj, *rows_obj;
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "O!OOOOn:take_rows", &PyList_Type, &sources_arg,
                          &source_of_row_obj, &starts_obj, &ends_obj, &rows_obj,
                          &width)) {
        return NULL;
    }
    /* A tuple of the sources: code run while their buffers are taken (a
     * class's __buffer__) cannot change what is indexed. */
    PyObject *sources = PyList_AsTuple(sources_arg);
    if (sources == NULL) {
        return NULL;
    }
    Py_ssize_t n_sources = PyTuple_GET_SIZE(sources);
    Py_buffer starts = {0}, ends = {0}, rows = {0}, which = {0};
    Py_buffer *views = NULL;
    const char **from = NULL;  /* each row's first byte, once checked */
    Py_ssize_t n_stored = 0, n_ends = 0, n_rows = 0, n_which = 0, acquired = 0;
    PyObject *offsets = NULL, *values = NULL, *result = NULL;
    if (n_sources == 0 || width <= 0) {
        PyErr_SetString(PyExc_ValueError,
                        "take_rows needs at least one source and a positive width");
        goto done;
    }
    views = PyMem_Calloc((size_t)n_sources, sizeof(Py_buffer));
    if (views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (int64_buffer(starts_obj, &starts, "starts", &n_stored) < 0
            || int64_buffer(ends_obj, &ends, "ends", &n_ends) < 0
            || int64_buffer(rows_obj, &rows, "rows", &n_rows) < 0) {
        goto done;
    }
    if (n_ends != n_stored) {
        PyErr_Format(PyExc_ValueError, "%zd starts but %zd ends", n_stored, n_ends);
        goto done;
    }
    if (source_of_row_obj != Py_None) {
        if (int64_buffer(source_of_row_obj, &which, "source_of_row", &n_which) < 0) {
            goto done;
        }
        if (n_which != n_stored) {
            PyErr_Format(PyExc_ValueError, "%zd sources of rows but %zd starts",
                         n_which, n_stored);
            goto done;
        }
    }
    for (; acquired < n_sources; acquired++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(sources, acquired), &views[acquired],
                               PyBUF_SIMPLE) < 0) {
            goto done;
        }
    }
    from = PyMem_Malloc((size_t)(n_rows > 0 ? n_rows : 1) * sizeof(char *));
    offsets = PyByteArray_FromStringAndSize(NULL, (n_rows + 1) * 8);
    if (from == NULL || offsets == NULL) {
        if (from == NULL) {
            PyErr_NoMemory();
        }
        goto done;
    }
    /* Every position is checked, and each row's place and size noted,
     * before anything is copied; the copy reads nothing else. */
    int64_t *offset = (int64_t *)PyByteArray_AS_STRING(offsets);
    Py_ssize_t total = 0;  /* bytes */
    offset[0] = 0;
    for (Py_ssize_t i = 0; i < n_rows; i++) {
        int64_t r = at(&rows, i);
        if (r < 0 || r >= n_stored) {
            PyErr_Format(PyExc_IndexError, "row %lld out of range for %zd rows",
                         (long long)r, n_stored);
            goto done;
        }
        int64_t s = which.buf ? at(&which, r) : 0;
        int64_t start = at(&starts, r), end = at(&ends, r);
        if (s < 0 || s >= n_sources || start < 0 || end < start
                || end > views[s].len / width) {
            PyErr_Format(PyExc_ValueError,
                         "row %lld: values %lld to %lld of source %lld are out of "
                         "its range", (long long)r, (long long)start,
                         (long long)end, (long long)s);
            goto done;
        }
        Py_ssize_t size = (Py_ssize_t)(end - start) * width;  /* within the source */
        if (size > PY_SSIZE_T_MAX - total) {
            PyErr_SetString(PyExc_OverflowError, "the rows taken are too large together");
            goto done;
        }
        total += size;
        offset[i + 1] = offset[i] + (end - start);
        from[i] = (const char *)views[s].buf + start * width;
    }
    values = PyByteArray_FromStringAndSize(NULL, total);
    if (values == NULL) {
        goto done;
    }
    char *out = PyByteArray_AS_STRING(values);
    for (Py_ssize_t i = 0; i < n_rows; i++) {
        size_t size = (size_t)((offset[i + 1] - offset[i]) * width);
        memcpy(out, from[i], size);
        out += size;
    }
    result = PyTuple_Pack(2, offsets, values);
done:
    for (Py_ssize_t k = 0; k < acquired; k++) {
        PyBuffer_Release(&views[k]);
    }
    PyMem_Free(views);
    PyMem_Free(from);
    if (starts.obj) PyBuffer_Release(&starts);
    if (ends.obj) PyBuffer_Release(&ends);
    if (rows.obj) PyBuffer_Release(&rows);
    if (which.obj) PyBuffer_Release(&which);
    Py_DECREF(sources);
    Py_XDECREF(offsets);
    Py_XDECREF(values);
    return result;
}

static PyMethodDef methods[] = {
    {"take_rows", take_rows, METH_VARARGS,
     "take_rows(sources, source_of_row, starts, ends, rows, width) -> "
     "(offsets, values): rows of values joined in one call (see the module)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "chainer_prefetch._take_rows",
    "Variable-length rows gathered in one call "
    "(chainer_prefetch.columnar.StoredRows).", -1, methods,
};

PyMODINIT_FUNC
PyInit__take_rows(void)
{
    return PyModule_Create(&module);
}
