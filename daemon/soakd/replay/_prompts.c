/* Prompt blocks in C: the same token ids as replay/prompts.py's numpy path, bit for bit, ~15x cheaper.
 *
 * A block is drawn from numpy's PCG64 seeded through a SeedSequence of the block's entropy words, read as
 * raw 64-bit words. In numpy each block pays a SeedSequence and a PCG64 object and ~20 array operations
 * on small arrays (~45 us a 512-token block: the largest single cost of soakd's main process per request
 * when prompts are unique). Here the same three algorithms run as plain loops:
 *   - SeedSequence (numpy/random/bit_generator.pyx): the entropy's uint32 words hashed into a pool of 4
 *     (mix_entropy), 8 words drawn from it (generate_state(4, uint64), little-endian pairs);
 *   - PCG64 (numpy/random/src/pcg64): XSL-RR 128/64, seeded as pcg64_set_seed(state words 0-1, inc 2-3);
 *   - the block (prompts.PromptSynth._blocks): 8 phrase lengths, 64 words, then phrases picked and
 *     copied end to end until the block is full.
 * tests/unit/replay/test_prompt_blocks.py holds this equal to the numpy path on any input.
 *
 * blocks(words, counts, size, allowed) -> bytes
 *   words: every block's entropy as uint32 words, end to end (a list of ints < 2**32);
 *   counts: how many words each block has; size: tokens a block; allowed: the token ids to draw from
 *   (a buffer of int32). Returns len(counts) * size int32 token ids, block after block.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define POOL 4
#define INIT_A 0x43b0d7e5u
#define MULT_A 0x931e8875u
#define INIT_B 0x8b51f9ddu
#define MULT_B 0x58f38dedu
#define MIX_MULT_L 0xca01f9ddu
#define MIX_MULT_R 0x4973f715u
#define XSHIFT 16

#define PHRASES 8
#define PHRASE_MIN 4
#define PHRASE_MAX 8
#define WORDS_AT PHRASES
#define PICKS_AT (PHRASES + PHRASES * PHRASE_MAX)

typedef unsigned __int128 u128;

static inline uint32_t hashmix(uint32_t value, uint32_t *hash_const) {
    value ^= *hash_const;
    *hash_const *= MULT_A;
    value *= *hash_const;
    value ^= value >> XSHIFT;
    return value;
}

static inline uint32_t mix(uint32_t x, uint32_t y) {
    uint32_t result = MIX_MULT_L * x - MIX_MULT_R * y;
    result ^= result >> XSHIFT;
    return result;
}

/* SeedSequence(entropy).generate_state(4, np.uint64) into out[4]. */
static void seed_state(const uint32_t *entropy, Py_ssize_t n, uint64_t out[4]) {
    uint32_t pool[POOL];
    uint32_t hash_const = INIT_A;
    for (int i = 0; i < POOL; i++) {
        pool[i] = hashmix(i < n ? entropy[i] : 0u, &hash_const);
    }
    for (int src = 0; src < POOL; src++) {
        for (int dst = 0; dst < POOL; dst++) {
            if (src != dst) {
                pool[dst] = mix(pool[dst], hashmix(pool[src], &hash_const));
            }
        }
    }
    for (Py_ssize_t src = POOL; src < n; src++) {
        for (int dst = 0; dst < POOL; dst++) {
            pool[dst] = mix(pool[dst], hashmix(entropy[src], &hash_const));
        }
    }
    uint32_t words[8];
    uint32_t hc = INIT_B;
    for (int i = 0; i < 8; i++) {
        uint32_t v = pool[i % POOL];
        v ^= hc;
        hc *= MULT_B;
        v *= hc;
        v ^= v >> XSHIFT;
        words[i] = v;
    }
    for (int i = 0; i < 4; i++) {
        out[i] = (uint64_t)words[2 * i] | ((uint64_t)words[2 * i + 1] << 32);
    }
}

typedef struct {
    u128 state;
    u128 inc;
} pcg64;

static const u128 PCG_MULT = (((u128)2549297995355413924ULL) << 64) | 4865540595714422341ULL;

static inline void pcg_step(pcg64 *rng) { rng->state = rng->state * PCG_MULT + rng->inc; }

static void pcg_seed(pcg64 *rng, const uint64_t v[4]) {
    u128 initstate = ((u128)v[0] << 64) | v[1];
    u128 initseq = ((u128)v[2] << 64) | v[3];
    rng->state = 0;
    rng->inc = (initseq << 1) | 1u;
    pcg_step(rng);
    rng->state += initstate;
    pcg_step(rng);
}

static inline uint64_t pcg_next(pcg64 *rng) {
    pcg_step(rng);
    uint64_t x = (uint64_t)(rng->state >> 64) ^ (uint64_t)rng->state;
    unsigned rot = (unsigned)(rng->state >> 122);
    return (x >> rot) | (x << ((-rot) & 63));
}

static inline uint64_t below(uint64_t raw, uint64_t n) { return ((raw >> 32) * n) >> 32; }

/* One block of `size` tokens from its entropy words. `raw` has room for PICKS_AT + ceil(size/4) words. */
static void one_block(const uint32_t *entropy, Py_ssize_t n, Py_ssize_t size, const int32_t *allowed,
                      uint64_t n_allowed, uint64_t *raw, int32_t *out) {
    uint64_t seed[4];
    pcg64 rng;
    seed_state(entropy, n, seed);
    pcg_seed(&rng, seed);
    Py_ssize_t picks = (size + PHRASE_MIN - 1) / PHRASE_MIN;
    for (Py_ssize_t i = 0; i < PICKS_AT + picks; i++) {
        raw[i] = pcg_next(&rng);
    }
    int lengths[PHRASES], starts[PHRASES];
    int at = 0;
    for (int p = 0; p < PHRASES; p++) {
        lengths[p] = (int)below(raw[p], PHRASE_MAX - PHRASE_MIN + 1) + PHRASE_MIN;
        starts[p] = at;
        at += lengths[p];
    }
    int32_t words[PHRASES * PHRASE_MAX];
    for (int j = 0; j < at; j++) { /* only the first sum(lengths) words are ever read */
        words[j] = allowed[below(raw[WORDS_AT + j], n_allowed)];
    }
    Py_ssize_t filled = 0;
    for (Py_ssize_t k = 0; k < picks && filled < size; k++) {
        int p = (int)below(raw[PICKS_AT + k], PHRASES);
        for (int t = 0; t < lengths[p] && filled < size; t++) {
            out[filled++] = words[starts[p] + t];
        }
    }
}

/* The token ids as int32: a C-contiguous buffer of 4-byte signed ints (numpy's int32), nothing else. */
static int int32_ids(PyObject *obj, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return -1;
    }
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') {
        f++;
    }
    if (view->itemsize != 4 || !(strcmp(f, "i") == 0 || strcmp(f, "l") == 0) || view->len < 4 ||
        ((uintptr_t)view->buf & 3u)) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "allowed must be a non-empty, aligned int32 buffer");
        return -1;
    }
    return 0;
}

static PyObject *blocks(PyObject *self, PyObject *args) {
    PyObject *words_obj, *counts_obj, *allowed_obj;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "OOnO", &words_obj, &counts_obj, &size, &allowed_obj)) {
        return NULL;
    }
    /* Bounded before anything is allocated: a block of at most 2**24 tokens (soakd allows far fewer). */
    if (size < 1 || size > (1 << 24)) {
        PyErr_SetString(PyExc_ValueError, "size must be >= 1 and at most 2**24");
        return NULL;
    }
    Py_buffer allowed;
    if (int32_ids(allowed_obj, &allowed) < 0) {
        return NULL;
    }
    PyObject *result = NULL, *words_seq = NULL, *counts_seq = NULL;
    uint32_t *entropy = NULL;
    uint64_t *raw = NULL;
    words_seq = PySequence_Fast(words_obj, "words must be a sequence");
    if (words_seq == NULL) {
        goto done;
    }
    counts_seq = PySequence_Fast(counts_obj, "counts must be a sequence");
    if (counts_seq == NULL) {
        goto done;
    }
    Py_ssize_t n_words = PySequence_Fast_GET_SIZE(words_seq);
    Py_ssize_t rows = PySequence_Fast_GET_SIZE(counts_seq);
    if (rows > PY_SSIZE_T_MAX / size / (Py_ssize_t)sizeof(int32_t)) {
        PyErr_SetString(PyExc_OverflowError, "too many tokens");
        goto done;
    }
    entropy = PyMem_Malloc(sizeof(uint32_t) * (size_t)(n_words ? n_words : 1));
    raw = PyMem_Malloc(sizeof(uint64_t) * (size_t)(PICKS_AT + (size + PHRASE_MIN - 1) / PHRASE_MIN));
    if (entropy == NULL || raw == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n_words; i++) {
        unsigned long long v = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(words_seq, i));
        if (v == (unsigned long long)-1 && PyErr_Occurred()) {
            goto done;
        }
        if (v > 0xffffffffULL) {
            PyErr_SetString(PyExc_ValueError, "an entropy word is above 2**32 - 1");
            goto done;
        }
        entropy[i] = (uint32_t)v;
    }
    result = PyBytes_FromStringAndSize(NULL, rows * size * (Py_ssize_t)sizeof(int32_t));
    if (result == NULL) {
        goto done;
    }
    int32_t *out = (int32_t *)PyBytes_AS_STRING(result);
    const int32_t *ids = (const int32_t *)allowed.buf;
    uint64_t n_allowed = (uint64_t)(allowed.len / (Py_ssize_t)sizeof(int32_t));
    Py_ssize_t at = 0;
    for (Py_ssize_t r = 0; r < rows; r++) {
        Py_ssize_t n = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(counts_seq, r));
        if (n == -1 && PyErr_Occurred()) {
            Py_CLEAR(result);
            goto done;
        }
        if (n < 0 || n > n_words - at) {
            PyErr_SetString(PyExc_ValueError, "counts do not match the words");
            Py_CLEAR(result);
            goto done;
        }
        one_block(entropy + at, n, size, ids, n_allowed, raw, out + r * size);
        at += n;
    }
    if (at != n_words) {
        PyErr_SetString(PyExc_ValueError, "counts do not match the words");
        Py_CLEAR(result);
    }
done:
    PyMem_Free(entropy);
    PyMem_Free(raw);
    Py_XDECREF(words_seq);
    Py_XDECREF(counts_seq);
    PyBuffer_Release(&allowed);
    return result;
}

static PyMethodDef methods[] = {
    {"blocks", blocks, METH_VARARGS,
     "blocks(words, counts, size, allowed) -> bytes: len(counts) * size int32 token ids"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_prompts", "Prompt blocks in C.", -1, methods};

PyMODINIT_FUNC PyInit__prompts(void) { return PyModule_Create(&module); }
