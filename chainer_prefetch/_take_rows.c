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

/* A contiguous buffer of int64 (`name` for the message); its length in *count. */
static int
int64_buffer(PyObject *obj, Py_buffer *view, const char *name, Py_ssize_t *count)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return -1;
    }
    if (view->itemsize != 8 || view->format == NULL
            || (strcmp(view->format, "l") != 0 && strcmp(view->format, "q") != 0
                && strcmp(view->format, "<q") != 0 && strcmp(view->format, "=q") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous int64 array", name);
        PyBuffer_Release(view);
        return -1;
    }
    *count = view->len / 8;
    return 0;
}

static PyObject *
take_rows(PyObject *self, PyObject *args)
{
    PyObject *sources, *source_of_row_obj, *starts_obj, *ends_obj, *rows_obj;
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "O!OOOOn:take_rows", &PyList_Type, &sources,
                          &source_of_row_obj, &starts_obj, &ends_obj, &rows_obj,
                          &width)) {
        return NULL;
    }
    Py_ssize_t n_sources = PyList_GET_SIZE(sources);
    if (n_sources == 0 || width <= 0) {
        PyErr_SetString(PyExc_ValueError,
                        "take_rows needs at least one source and a positive width");
        return NULL;
    }
    Py_buffer starts = {0}, ends = {0}, rows = {0}, which = {0};
    Py_buffer *views = PyMem_Calloc((size_t)n_sources, sizeof(Py_buffer));
    Py_ssize_t n_stored = 0, n_ends = 0, n_rows = 0, n_which = 0, acquired = 0;
    PyObject *offsets = NULL, *values = NULL, *result = NULL;
    if (views == NULL) {
        return PyErr_NoMemory();
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
        if (PyObject_GetBuffer(PyList_GET_ITEM(sources, acquired), &views[acquired],
                               PyBUF_SIMPLE) < 0) {
            goto done;
        }
    }
    const int64_t *start = starts.buf, *end = ends.buf, *row = rows.buf;
    const int64_t *source = which.buf;  /* NULL: every row of source 0 */

    offsets = PyByteArray_FromStringAndSize(NULL, (n_rows + 1) * 8);
    if (offsets == NULL) {
        goto done;
    }
    int64_t *offset = (int64_t *)PyByteArray_AS_STRING(offsets);
    offset[0] = 0;
    for (Py_ssize_t i = 0; i < n_rows; i++) {
        int64_t r = row[i];
        if (r < 0 || r >= n_stored) {
            PyErr_Format(PyExc_IndexError, "row %lld out of range for %zd rows",
                         (long long)r, n_stored);
            goto done;
        }
        int64_t s = source ? source[r] : 0;
        if (s < 0 || s >= n_sources || start[r] < 0 || end[r] < start[r]
                || end[r] > views[s].len / width) {
            PyErr_Format(PyExc_ValueError,
                         "row %lld: values %lld to %lld of source %lld are out of "
                         "its range", (long long)r, (long long)start[r],
                         (long long)end[r], (long long)s);
            goto done;
        }
        offset[i + 1] = offset[i] + (end[r] - start[r]);
    }
    values = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(offset[n_rows] * width));
    if (values == NULL) {
        goto done;
    }
    char *out = PyByteArray_AS_STRING(values);
    for (Py_ssize_t i = 0; i < n_rows; i++) {
        int64_t r = row[i];
        const char *from = (const char *)views[source ? source[r] : 0].buf;
        size_t size = (size_t)((end[r] - start[r]) * width);
        memcpy(out, from + start[r] * width, size);
        out += size;
    }
    result = PyTuple_Pack(2, offsets, values);
done:
    for (Py_ssize_t k = 0; k < acquired; k++) {
        PyBuffer_Release(&views[k]);
    }
    PyMem_Free(views);
    if (starts.obj) PyBuffer_Release(&starts);
    if (ends.obj) PyBuffer_Release(&ends);
    if (rows.obj) PyBuffer_Release(&rows);
    if (which.obj) PyBuffer_Release(&which);
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
