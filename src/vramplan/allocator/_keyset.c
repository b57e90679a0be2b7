/* A long free list in C: vramplan.allocator._keyset.KeySet.
 *
 * The same sorted set of distinct non-negative integer keys (size << SHIFT | addr, < 2**128) as
 * freelist.Blocked, with the same methods (ge, lt, add, remove, len, iteration in order, equality
 * with a list), and so the same answers: only the cost differs. Blocked keeps Python ints in
 * sorted runs and compares them as Python objects; here each key is held as an unsigned
 * 128-bit number beside its int object, runs of at most RUN_MAX entries are plain C arrays, and
 * every search compares machine integers. freelist.add makes a long free list a KeySet when this
 * module is built (setup.py builds it where a C compiler is found; freelist.Blocked otherwise).
 * tests/test_allocator_keyset.py checks it against Blocked and a sorted list, operation by
 * operation.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

typedef unsigned __int128 u128;

#define RUN_MAX 128 /* a run is split in two past this many keys */
#define RUN_MIN 32  /* a run shorter than this joins the one before */
#define SHIFT 47    /* keys are size << SHIFT | addr (blocks.SHIFT; checked at import by freelist) */

typedef struct {
    u128 v;
    PyObject *key; /* the int object, returned by ge/lt and iteration */
} Entry;

typedef struct {
    Py_ssize_t n;
    Entry e[RUN_MAX + 1];
} Run;

typedef struct {
    PyObject_HEAD
    Py_ssize_t n;     /* keys in all */
    Py_ssize_t nruns; /* runs in use */
    Py_ssize_t cap;   /* runs allocated */
    Run **runs;
    u128 *maxes; /* maxes[j] == runs[j]->e[runs[j]->n - 1].v */
} KeySet;

/* The key's value; -1 (with an exception) for a negative or non-int key or one of 128 bits or more. */
static int as_u128(PyObject *o, u128 *out)
{
    unsigned char buf[16];
    if (!PyLong_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "KeySet keys are ints");
        return -1;
    }
#if PY_VERSION_HEX >= 0x030D0000
    Py_ssize_t need = PyLong_AsNativeBytes(o, buf, 16, Py_ASNATIVEBYTES_LITTLE_ENDIAN | Py_ASNATIVEBYTES_UNSIGNED_BUFFER
                                                           | Py_ASNATIVEBYTES_REJECT_NEGATIVE);
    if (need < 0)
        return -1;
    if (need > 16) {
        PyErr_SetString(PyExc_OverflowError, "KeySet keys are below 2**128");
        return -1;
    }
#else
    if (_PyLong_Sign(o) < 0) {
        PyErr_SetString(PyExc_ValueError, "KeySet keys are non-negative");
        return -1;
    }
    if (_PyLong_AsByteArray((PyLongObject *)o, buf, 16, 1, 0) < 0)
        return -1;
#endif
    u128 v = 0;
    for (int i = 15; i >= 0; i--)
        v = (v << 8) | buf[i];
    *out = v;
    return 0;
}

/* First index in a[0:n] whose value is >= v. */
static inline Py_ssize_t lower_u128(const u128 *a, Py_ssize_t n, u128 v)
{
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) >> 1;
        if (a[mid] < v)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static inline Py_ssize_t lower_run(const Run *r, u128 v)
{
    Py_ssize_t lo = 0, hi = r->n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) >> 1;
        if (r->e[mid].v < v)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static int grow(KeySet *s)
{
    if (s->nruns < s->cap)
        return 0;
    Py_ssize_t cap = s->cap ? 2 * s->cap : 8;
    Run **runs = PyMem_Realloc(s->runs, cap * sizeof(Run *));
    if (!runs) {
        PyErr_NoMemory();
        return -1;
    }
    s->runs = runs;
    u128 *maxes = PyMem_Realloc(s->maxes, cap * sizeof(u128));
    if (!maxes) {
        PyErr_NoMemory();
        return -1;
    }
    s->maxes = maxes;
    s->cap = cap;
    return 0;
}

/* A new empty run at index j (runs after it move up). */
static Run *insert_run(KeySet *s, Py_ssize_t j)
{
    if (grow(s) < 0)
        return NULL;
    Run *r = PyMem_Malloc(sizeof(Run));
    if (!r) {
        PyErr_NoMemory();
        return NULL;
    }
    r->n = 0;
    memmove(s->runs + j + 1, s->runs + j, (s->nruns - j) * sizeof(Run *));
    memmove(s->maxes + j + 1, s->maxes + j, (s->nruns - j) * sizeof(u128));
    s->runs[j] = r;
    s->nruns++;
    return r;
}

static void delete_run(KeySet *s, Py_ssize_t j)
{
    PyMem_Free(s->runs[j]);
    memmove(s->runs + j, s->runs + j + 1, (s->nruns - j - 1) * sizeof(Run *));
    memmove(s->maxes + j, s->maxes + j + 1, (s->nruns - j - 1) * sizeof(u128));
    s->nruns--;
}

/* Split run j in two if it is longer than RUN_MAX. */
static int split(KeySet *s, Py_ssize_t j)
{
    Run *r = s->runs[j];
    if (r->n <= RUN_MAX)
        return 0;
    Run *t = insert_run(s, j + 1);
    if (!t)
        return -1;
    r = s->runs[j];
    Py_ssize_t keep = r->n / 2;
    t->n = r->n - keep;
    memcpy(t->e, r->e + keep, t->n * sizeof(Entry));
    r->n = keep;
    s->maxes[j] = r->e[keep - 1].v;
    s->maxes[j + 1] = t->e[t->n - 1].v;
    return 0;
}

/* Insert (v, key) (key borrowed; a new reference is taken), v not present. */
static int insert(KeySet *s, u128 v, PyObject *key)
{
    Py_ssize_t j;
    Run *r;
    if (s->nruns == 0) {
        r = insert_run(s, 0);
        if (!r)
            return -1;
        j = 0;
    }
    else {
        j = lower_u128(s->maxes, s->nruns, v);
        if (j == s->nruns)
            j--;
        r = s->runs[j];
    }
    Py_ssize_t i = lower_run(r, v);
    if (i < r->n && r->e[i].v == v) {
        PyErr_SetString(PyExc_ValueError, "KeySet.add: the key is already held");
        return -1;
    }
    memmove(r->e + i + 1, r->e + i, (r->n - i) * sizeof(Entry));
    r->e[i].v = v;
    Py_INCREF(key);
    r->e[i].key = key;
    r->n++;
    if (i == r->n - 1)
        s->maxes[j] = v;
    s->n++;
    return split(s, j);
}

static int KeySet_init(KeySet *s, PyObject *args, PyObject *kwds)
{
    PyObject *keys = NULL;
    if (!PyArg_ParseTuple(args, "|O:KeySet", &keys))
        return -1;
    if (s->nruns) {
        PyErr_SetString(PyExc_RuntimeError, "KeySet is initialised once");
        return -1;
    }
    if (!keys)
        return 0;
    PyObject *it = PyObject_GetIter(keys);
    if (!it)
        return -1;
    PyObject *k;
    while ((k = PyIter_Next(it))) {
        u128 v;
        int bad = as_u128(k, &v) < 0;
        if (!bad) {
            if (s->nruns && v <= s->maxes[s->nruns - 1]) {
                PyErr_SetString(PyExc_ValueError, "KeySet(keys): keys must be sorted and distinct");
                bad = 1;
            }
        }
        if (!bad) { /* appended: the last run fills to RUN_MAX / 2 + ..., then a new one starts */
            Run *r = s->nruns ? s->runs[s->nruns - 1] : NULL;
            if (!r || r->n >= RUN_MAX / 2 + RUN_MAX / 4) {
                r = insert_run(s, s->nruns);
                bad = r == NULL;
            }
            if (!bad) {
                Py_INCREF(k);
                r->e[r->n].v = v;
                r->e[r->n].key = k;
                r->n++;
                s->maxes[s->nruns - 1] = v;
                s->n++;
            }
        }
        Py_DECREF(k);
        if (bad) {
            Py_DECREF(it);
            return -1;
        }
    }
    Py_DECREF(it);
    return PyErr_Occurred() ? -1 : 0;
}

static void KeySet_dealloc(KeySet *s)
{
    for (Py_ssize_t j = 0; j < s->nruns; j++) {
        Run *r = s->runs[j];
        for (Py_ssize_t i = 0; i < r->n; i++)
            Py_DECREF(r->e[i].key);
        PyMem_Free(r);
    }
    PyMem_Free(s->runs);
    PyMem_Free(s->maxes);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *minus_one(void) { return PyLong_FromLong(-1); }

/* The smallest key >= x; -1 if none. */
static PyObject *KeySet_ge(KeySet *s, PyObject *x)
{
    u128 v;
    if (as_u128(x, &v) < 0)
        return NULL;
    Py_ssize_t j = lower_u128(s->maxes, s->nruns, v);
    if (j == s->nruns)
        return minus_one();
    Run *r = s->runs[j];
    PyObject *k = r->e[lower_run(r, v)].key;
    Py_INCREF(k);
    return k;
}

/* The largest key < x; -1 if none. */
static PyObject *KeySet_lt(KeySet *s, PyObject *x)
{
    u128 v;
    if (as_u128(x, &v) < 0)
        return NULL;
    Py_ssize_t j = lower_u128(s->maxes, s->nruns, v);
    if (j < s->nruns) {
        Run *r = s->runs[j];
        Py_ssize_t i = lower_run(r, v);
        if (i) {
            PyObject *k = r->e[i - 1].key;
            Py_INCREF(k);
            return k;
        }
    }
    if (!j)
        return minus_one();
    Run *p = s->runs[j - 1];
    PyObject *k = p->e[p->n - 1].key;
    Py_INCREF(k);
    return k;
}

static PyObject *KeySet_add(KeySet *s, PyObject *key)
{
    u128 v;
    if (as_u128(key, &v) < 0 || insert(s, v, key) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* Remove entry i of run j; its key object is returned (the reference the set held), NULL on error. */
static PyObject *remove_at(KeySet *s, Py_ssize_t j, Py_ssize_t i)
{
    Run *r = s->runs[j];
    PyObject *old = r->e[i].key;
    memmove(r->e + i, r->e + i + 1, (r->n - i - 1) * sizeof(Entry));
    r->n--;
    s->n--;
    if (r->n == 0)
        delete_run(s, j);
    else {
        if (i == r->n)
            s->maxes[j] = r->e[r->n - 1].v;
        if (j && r->n < RUN_MIN) { /* joins the run before (the runs stay near RUN_MAX / 2 or more) */
            Run *p = s->runs[j - 1];
            if (p->n + r->n <= RUN_MAX + 1) {
                memcpy(p->e + p->n, r->e, r->n * sizeof(Entry));
                p->n += r->n;
                s->maxes[j - 1] = s->maxes[j];
                delete_run(s, j);
                if (split(s, j - 1) < 0) {
                    Py_DECREF(old);
                    return NULL;
                }
            }
        }
    }
    return old;
}

/* Remove key, which must be present. */
static PyObject *KeySet_remove(KeySet *s, PyObject *key)
{
    u128 v;
    if (as_u128(key, &v) < 0)
        return NULL;
    Py_ssize_t j = lower_u128(s->maxes, s->nruns, v);
    Run *r = j < s->nruns ? s->runs[j] : NULL;
    Py_ssize_t i = r ? lower_run(r, v) : 0;
    if (!r || r->e[i].v != v) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    PyObject *old = remove_at(s, j, i);
    if (!old)
        return NULL;
    Py_DECREF(old);
    Py_RETURN_NONE;
}

/* A non-negative int as a u64, saturated at 2**64 - 1 (-1 with an exception if negative or not an int). */
static int as_u64_sat(PyObject *o, unsigned long long *out)
{
    unsigned long long x = PyLong_AsUnsignedLongLong(o);
    if (x == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError) || _PyLong_Sign(o) < 0)
            return -1;
        PyErr_Clear();
    }
    *out = x;
    return 0;
}

/* A block's size and address (non-negative, below 2**63) as the key's value size << SHIFT | addr. */
static int block_value(PyObject *size_o, PyObject *addr_o, u128 *out)
{
    Py_ssize_t size = PyLong_AsSsize_t(size_o), addr;
    if (size == -1 && PyErr_Occurred())
        return -1;
    addr = PyLong_AsSsize_t(addr_o);
    if (addr == -1 && PyErr_Occurred())
        return -1;
    if (size < 0 || addr < 0 || (unsigned long long)addr >> SHIFT) {
        PyErr_SetString(PyExc_ValueError, "KeySet: a block's size and address are >= 0, the address below 2**SHIFT");
        return -1;
    }
    *out = ((u128)(unsigned long long)size << SHIFT) | (u128)(unsigned long long)addr;
    return 0;
}

/* put(key, size, addr): add(key) for key == size << SHIFT | addr, which the caller has at hand
 * (read from the two small ints: converting the key itself costs more). */
static PyObject *KeySet_put(KeySet *s, PyObject *const *args, Py_ssize_t nargs)
{
    u128 v;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "put(key, size, addr) takes three ints");
        return NULL;
    }
    if (!PyLong_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "KeySet keys are ints");
        return NULL;
    }
    if (block_value(args[1], args[2], &v) < 0 || insert(s, v, args[0]) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* drop(size, addr): remove(size << SHIFT | addr), which must be present. */
static PyObject *KeySet_drop(KeySet *s, PyObject *const *args, Py_ssize_t nargs)
{
    u128 v;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "drop(size, addr) takes two ints");
        return NULL;
    }
    if (block_value(args[0], args[1], &v) < 0)
        return NULL;
    Py_ssize_t j = lower_u128(s->maxes, s->nruns, v);
    Run *r = j < s->nruns ? s->runs[j] : NULL;
    Py_ssize_t i = r ? lower_run(r, v) : 0;
    if (!r || r->e[i].v != v) {
        PyErr_SetString(PyExc_KeyError, "drop: no such block in the set");
        return NULL;
    }
    PyObject *old = remove_at(s, j, i);
    if (!old)
        return NULL;
    Py_DECREF(old);
    Py_RETURN_NONE;
}

/* take(size, limit): the best fit's key for a block of ``size`` bytes, removed; -1 if none.
 * The smallest key >= size << SHIFT, taken only if its size (key >> SHIFT) is below ``limit``. */
static PyObject *KeySet_take(KeySet *s, PyObject *const *args, Py_ssize_t nargs)
{
    unsigned long long size, limit;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "take(size, limit) takes two ints");
        return NULL;
    }
    if (as_u64_sat(args[0], &size) < 0 || as_u64_sat(args[1], &limit) < 0)
        return NULL;
    u128 v = (u128)size << SHIFT;
    Py_ssize_t j = lower_u128(s->maxes, s->nruns, v);
    if (j == s->nruns)
        return minus_one();
    Run *r = s->runs[j];
    Py_ssize_t i = lower_run(r, v);
    if ((r->e[i].v >> SHIFT) >= (u128)limit)
        return minus_one();
    return remove_at(s, j, i);
}

static PyObject *KeySet_tolist(KeySet *s, PyObject *Py_UNUSED(ignored))
{
    PyObject *out = PyList_New(s->n);
    if (!out)
        return NULL;
    Py_ssize_t at = 0;
    for (Py_ssize_t j = 0; j < s->nruns; j++) {
        Run *r = s->runs[j];
        for (Py_ssize_t i = 0; i < r->n; i++) {
            Py_INCREF(r->e[i].key);
            PyList_SET_ITEM(out, at++, r->e[i].key);
        }
    }
    return out;
}

/* Runs' lengths, in order (for the invariant checks of allocator.check). */
static PyObject *KeySet_run_lengths(KeySet *s, PyObject *Py_UNUSED(ignored))
{
    PyObject *out = PyList_New(s->nruns);
    if (!out)
        return NULL;
    for (Py_ssize_t j = 0; j < s->nruns; j++) {
        PyObject *n = PyLong_FromSsize_t(s->runs[j]->n);
        if (!n) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, j, n);
    }
    return out;
}

static Py_ssize_t KeySet_len(KeySet *s) { return s->n; }

static PyObject *KeySet_iter(KeySet *s)
{
    PyObject *all = KeySet_tolist(s, NULL);
    if (!all)
        return NULL;
    PyObject *it = PyObject_GetIter(all);
    Py_DECREF(all);
    return it;
}

/* Equal to a list, a KeySet or anything iterable with the same keys in the same order. */
static PyObject *KeySet_richcompare(KeySet *s, PyObject *other, int op)
{
    if (op != Py_EQ && op != Py_NE)
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *mine = KeySet_tolist(s, NULL);
    if (!mine)
        return NULL;
    PyObject *theirs = PyList_Check(other) ? (Py_INCREF(other), other) : PySequence_List(other);
    if (!theirs) {
        Py_DECREF(mine);
        PyErr_Clear();
        Py_RETURN_NOTIMPLEMENTED;
    }
    PyObject *res = PyObject_RichCompare(mine, theirs, op);
    Py_DECREF(mine);
    Py_DECREF(theirs);
    return res;
}

static PyMethodDef KeySet_methods[] = {
    {"ge", (PyCFunction)KeySet_ge, METH_O, "The smallest key >= x; -1 if none."},
    {"lt", (PyCFunction)KeySet_lt, METH_O, "The largest key < x; -1 if none."},
    {"add", (PyCFunction)KeySet_add, METH_O, "Insert a key that is not held."},
    {"remove", (PyCFunction)KeySet_remove, METH_O, "Remove a key that is held (KeyError otherwise)."},
    {"put", (PyCFunction)(void (*)(void))KeySet_put, METH_FASTCALL,
     "put(key, size, addr): add(key), where key == size << SHIFT | addr."},
    {"drop", (PyCFunction)(void (*)(void))KeySet_drop, METH_FASTCALL,
     "drop(size, addr): remove(size << SHIFT | addr), which is held."},
    {"take", (PyCFunction)(void (*)(void))KeySet_take, METH_FASTCALL,
     "take(size, limit): the smallest key >= size << SHIFT, removed, if its size is below limit; else -1."},
    {"tolist", (PyCFunction)KeySet_tolist, METH_NOARGS, "The keys in order, as a list."},
    {"run_lengths", (PyCFunction)KeySet_run_lengths, METH_NOARGS, "Each run's number of keys, in order."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods KeySet_as_sequence = {
    .sq_length = (lenfunc)KeySet_len,
};

static PyTypeObject KeySetType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "vramplan.allocator._keyset.KeySet",
    .tp_doc = "Sorted distinct non-negative int keys below 2**128, held in C (see freelist.Blocked).",
    .tp_basicsize = sizeof(KeySet),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)KeySet_init,
    .tp_dealloc = (destructor)KeySet_dealloc,
    .tp_methods = KeySet_methods,
    .tp_as_sequence = &KeySet_as_sequence,
    .tp_iter = (getiterfunc)KeySet_iter,
    .tp_richcompare = (richcmpfunc)KeySet_richcompare,
    .tp_hash = PyObject_HashNotImplemented,
};

static PyModuleDef keyset_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "vramplan.allocator._keyset",
    .m_doc = "A long free list's sorted keys in C (see vramplan.allocator.freelist).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__keyset(void)
{
    if (PyType_Ready(&KeySetType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&keyset_module);
    if (!m)
        return NULL;
    Py_INCREF(&KeySetType);
    if (PyModule_AddObject(m, "KeySet", (PyObject *)&KeySetType) < 0) {
        Py_DECREF(&KeySetType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "RUN_MAX", RUN_MAX) < 0 || PyModule_AddIntConstant(m, "RUN_MIN", RUN_MIN) < 0
        || PyModule_AddIntConstant(m, "SHIFT", SHIFT) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
