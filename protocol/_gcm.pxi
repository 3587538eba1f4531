# AES-GCM through OpenSSL's EVP interface, for the sealing loops of _codec.pyx (included
# there, so that they reach Record's fields).
#
# Contract. ``load_gcm(path)`` binds the libcrypto at ``path`` (OpenSSL 1.1 or 3; the one
# Python's own hashlib and ssl modules load) and raises OSError naming what is missing;
# until it succeeded, ``AesGcm(key)`` raises RuntimeError. ``AesGcm`` is AES-GCM with a
# 128-, 192- or 256-bit key whose ``encrypt(nonce, data, aad)`` and ``decrypt(nonce,
# data, aad)`` give the same bytes as ``cryptography``'s ``AESGCM`` (ciphertext then
# a 16-byte tag); ``decrypt`` raises ValueError when the tag does not match. Given as
# the cipher of ``seal_values``/``open_values`` (the object or its bound ``encrypt`` /
# ``decrypt``), it runs a whole batch's records without a Python call per record and
# without the GIL.
#
# ``load_sodium(path)`` binds libsodium's AES-256-GCM too (the library PyNaCl bundles):
# where it is bound and the CPU has AES-NI and PCLMULQDQ, a 256-bit key with 12-byte
# nonces runs through it instead, with the same bytes. Its key state is computed once
# per key and read by any number of threads at once; OpenSSL 3.0's EVP interface costs
# about 200 ns of set-up per call, close to half the cost of a 1 KiB record.
#
# Why bind OpenSSL here rather than call ``cryptography``: its AEAD objects take one
# Python call per field and hold the GIL, and the call, the argument slices and the
# result's copy cost a 1 KiB record more than the cipher itself. The symbols are looked
# up at run time (dlopen), so building kiproxy needs no OpenSSL headers; every cipher
# context is owned by one call at a time (a key keeps one spare per direction for
# 12-byte nonces, lent and taken back with the GIL held), so one key is safe to use
# from several threads at once.

from posix.dlfcn cimport RTLD_LOCAL, RTLD_NOW, dlerror, dlopen, dlsym

ctypedef void* (*_ctx_new_t)() noexcept nogil
ctypedef void (*_ctx_free_t)(void*) noexcept nogil
ctypedef const void* (*_cipher_t)() noexcept nogil
ctypedef int (*_init_t)(void*, const void*, void*, const unsigned char*,
                        const unsigned char*) noexcept nogil
ctypedef int (*_ctrl_t)(void*, int, int, void*) noexcept nogil
ctypedef int (*_update_t)(void*, unsigned char*, int*, const unsigned char*, int) noexcept nogil
ctypedef int (*_final_t)(void*, unsigned char*, int*) noexcept nogil

cdef enum:
    _GCM_SET_IVLEN = 0x9   # EVP_CTRL_AEAD_SET_IVLEN
    _GCM_GET_TAG = 0x10    # EVP_CTRL_AEAD_GET_TAG
    _GCM_SET_TAG = 0x11    # EVP_CTRL_AEAD_SET_TAG
    GCM_TAG_BYTES = 16

cdef struct _Evp:
    _ctx_new_t ctx_new
    _ctx_free_t ctx_free
    _cipher_t gcm128
    _cipher_t gcm192
    _cipher_t gcm256
    _ctrl_t ctrl
    _init_t encrypt_init
    _update_t encrypt_update
    _final_t encrypt_final
    _init_t decrypt_init
    _update_t decrypt_update
    _final_t decrypt_final

cdef _Evp _evp
cdef bint _evp_loaded = False

ctypedef int (*_sodium_init_t)() noexcept nogil
ctypedef size_t (*_sodium_size_t)() noexcept nogil
ctypedef int (*_sodium_before_t)(void* state, const unsigned char* key) noexcept nogil
ctypedef int (*_sodium_seal_t)(unsigned char* c, unsigned char* mac,
                               unsigned long long* mac_len, const unsigned char* m,
                               unsigned long long m_len, const unsigned char* ad,
                               unsigned long long ad_len, const unsigned char* nsec,
                               const unsigned char* npub, const void* state) noexcept nogil
ctypedef int (*_sodium_open_t)(unsigned char* m, unsigned char* nsec,
                               const unsigned char* c, unsigned long long c_len,
                               const unsigned char* mac, const unsigned char* ad,
                               unsigned long long ad_len, const unsigned char* npub,
                               const void* state) noexcept nogil
ctypedef void (*_sodium_zero_t)(void* at, size_t n) noexcept nogil

cdef struct _Sodium:
    _sodium_before_t before
    _sodium_seal_t seal
    _sodium_open_t open
    _sodium_zero_t zero
    size_t state_bytes

cdef _Sodium _sodium
cdef bint _sodium_loaded = False

cdef extern from "<stdlib.h>" nogil:
    int posix_memalign(void** at, size_t alignment, size_t size)
    void free(void* at)


cdef struct GcmCtx:
    # What one call seals or opens with: an OpenSSL context (one caller's at a time),
    # or a libsodium key state (shared, read only).
    void* evp
    const void* sodium


cdef void* _library(str path) except NULL:
    """The shared library at ``path``, loaded (or found loaded); OSError saying why not."""
    cdef void* lib = dlopen(path.encode(), RTLD_NOW | RTLD_LOCAL)
    if lib == NULL:
        raise OSError(f"cannot load {path}: {(<bytes>dlerror()).decode(errors='replace')}")
    return lib


cdef void* _symbol(void* lib, bytes name, str library) except NULL:
    """``name`` in ``lib``; OSError naming ``library`` when it has none."""
    cdef void* found = dlsym(lib, name)
    if found == NULL:
        raise OSError(f"{library} has no {name.decode()}")
    return found


def load_gcm(str path):
    """Bind AES-GCM from the libcrypto at ``path``; OSError when it cannot be."""
    global _evp, _evp_loaded
    if _evp_loaded:
        return
    cdef void* lib = _library(path)
    cdef _Evp e
    e.ctx_new = <_ctx_new_t>_symbol(lib, b"EVP_CIPHER_CTX_new", "libcrypto")
    e.ctx_free = <_ctx_free_t>_symbol(lib, b"EVP_CIPHER_CTX_free", "libcrypto")
    e.gcm128 = <_cipher_t>_symbol(lib, b"EVP_aes_128_gcm", "libcrypto")
    e.gcm192 = <_cipher_t>_symbol(lib, b"EVP_aes_192_gcm", "libcrypto")
    e.gcm256 = <_cipher_t>_symbol(lib, b"EVP_aes_256_gcm", "libcrypto")
    e.ctrl = <_ctrl_t>_symbol(lib, b"EVP_CIPHER_CTX_ctrl", "libcrypto")
    e.encrypt_init = <_init_t>_symbol(lib, b"EVP_EncryptInit_ex", "libcrypto")
    e.encrypt_update = <_update_t>_symbol(lib, b"EVP_EncryptUpdate", "libcrypto")
    e.encrypt_final = <_final_t>_symbol(lib, b"EVP_EncryptFinal_ex", "libcrypto")
    e.decrypt_init = <_init_t>_symbol(lib, b"EVP_DecryptInit_ex", "libcrypto")
    e.decrypt_update = <_update_t>_symbol(lib, b"EVP_DecryptUpdate", "libcrypto")
    e.decrypt_final = <_final_t>_symbol(lib, b"EVP_DecryptFinal_ex", "libcrypto")
    _evp = e
    _evp_loaded = True


def load_sodium(str path, tuple known not None):
    """Bind AES-256-GCM from the libsodium at ``path``; OSError when it cannot be, when
    libsodium says this CPU lacks what its AES-GCM needs (AES-NI, PCLMULQDQ), or when it
    does not give the bytes of the ``known`` answer: ``(key, nonce, plaintext, aad,
    ciphertext and tag)``, a 256-bit key and a 12-byte nonce."""
    global _sodium, _sodium_loaded
    if _sodium_loaded:
        return
    cdef bytes key, nonce, plain, aad, sealed
    key, nonce, plain, aad, sealed = known
    if PyBytes_GET_SIZE(key) != 32 or PyBytes_GET_SIZE(nonce) != 12 \
            or PyBytes_GET_SIZE(sealed) != PyBytes_GET_SIZE(plain) + GCM_TAG_BYTES:
        raise ValueError("the known answer is a 256-bit key, a 12-byte nonce, a plaintext, "
                         "an aad and the ciphertext with its tag")
    cdef void* lib = _library(path)
    cdef _Sodium s
    cdef _sodium_init_t init = <_sodium_init_t>_symbol(lib, b"sodium_init", path)
    cdef _sodium_init_t available = <_sodium_init_t>_symbol(
        lib, b"crypto_aead_aes256gcm_is_available", path)
    cdef _sodium_size_t state_bytes = <_sodium_size_t>_symbol(
        lib, b"crypto_aead_aes256gcm_statebytes", path)
    s.before = <_sodium_before_t>_symbol(lib, b"crypto_aead_aes256gcm_beforenm", path)
    s.seal = <_sodium_seal_t>_symbol(
        lib, b"crypto_aead_aes256gcm_encrypt_detached_afternm", path)
    s.open = <_sodium_open_t>_symbol(
        lib, b"crypto_aead_aes256gcm_decrypt_detached_afternm", path)
    s.zero = <_sodium_zero_t>_symbol(lib, b"sodium_memzero", path)
    if init() < 0:
        raise OSError(f"sodium_init of {path} failed")
    if not available():
        raise OSError("libsodium's AES-256-GCM needs AES-NI and PCLMULQDQ, which this CPU "
                      "lacks")
    s.state_bytes = state_bytes()
    cdef void* state = NULL
    cdef bytes out = PyBytes_FromStringAndSize(NULL, PyBytes_GET_SIZE(sealed))
    cdef bytes back = PyBytes_FromStringAndSize(NULL, PyBytes_GET_SIZE(plain))
    cdef unsigned char* o = <unsigned char*>PyBytes_AS_STRING(out)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(plain)
    cdef const unsigned char* a = <const unsigned char*>PyBytes_AS_STRING(aad)
    cdef const unsigned char* iv = <const unsigned char*>PyBytes_AS_STRING(nonce)
    if posix_memalign(&state, 64, s.state_bytes) != 0:
        raise MemoryError()
    try:
        if (s.before(state, <const unsigned char*>PyBytes_AS_STRING(key)) != 0
                or s.seal(o, o + n, NULL, <const unsigned char*>PyBytes_AS_STRING(plain), n,
                          a, PyBytes_GET_SIZE(aad), NULL, iv, state) != 0
                or out != sealed
                or s.open(<unsigned char*>PyBytes_AS_STRING(back), NULL, o, n, o + n, a,
                          PyBytes_GET_SIZE(aad), iv, state) != 0
                or back != plain):
            raise OSError(f"libsodium's AES-256-GCM at {path} does not give the known answer")
    finally:
        s.zero(state, s.state_bytes)
        free(state)
    _sodium = s
    _sodium_loaded = True


def sodium_bound():
    """Whether AES-256-GCM with 12-byte nonces runs through libsodium (``load_sodium``)."""
    return _sodium_loaded


cdef class AesGcm:
    """AesGcm(key): AES-GCM under ``key`` (16, 24 or 32 bytes) through OpenSSL, with the
    ``encrypt``/``decrypt`` of ``cryptography``'s ``AESGCM`` (see ``load_gcm``)."""

    cdef bytes _key
    cdef void* _sealing    # kept for encrypt() with 12-byte nonces (GIL held)
    cdef void* _opening    # kept for decrypt() with 12-byte nonces (GIL held)
    cdef void* _state      # libsodium's key state, for 12-byte nonces (256-bit keys)

    def __init__(self, bytes key not None):
        if not _evp_loaded:
            raise RuntimeError("AES-GCM is not bound to a libcrypto (load_gcm)")
        if PyBytes_GET_SIZE(key) not in (16, 24, 32):
            raise ValueError(f"an AES key is 16, 24 or 32 bytes, not {PyBytes_GET_SIZE(key)}")
        if self._sealing != NULL or self._opening != NULL or self._state != NULL:
            raise RuntimeError("an AesGcm is initialised once")
        self._key = key
        if _sodium_loaded and PyBytes_GET_SIZE(key) == 32:
            if posix_memalign(&self._state, 64, _sodium.state_bytes) != 0:
                self._state = NULL
                raise MemoryError()
            if _sodium.before(self._state, <const unsigned char*>PyBytes_AS_STRING(key)) != 0:
                free(self._state)
                self._state = NULL  # OpenSSL serves this key

    def __dealloc__(self):
        if self._sealing != NULL:
            _evp.ctx_free(self._sealing)
        if self._opening != NULL:
            _evp.ctx_free(self._opening)
        if self._state != NULL:
            _sodium.zero(self._state, _sodium.state_bytes)
            free(self._state)

    def __repr__(self):
        return f"AesGcm(<{PyBytes_GET_SIZE(self._key) * 8}-bit key>)"

    cdef void* _context(self, bint encrypting, Py_ssize_t nonce_bytes) except NULL:
        """A cipher context with this key and ``nonce_bytes`` nonces; the caller frees it."""
        cdef Py_ssize_t n = PyBytes_GET_SIZE(self._key)
        cdef const void* cipher = (_evp.gcm128() if n == 16 else
                                   _evp.gcm192() if n == 24 else _evp.gcm256())
        cdef const unsigned char* key = <const unsigned char*>PyBytes_AS_STRING(self._key)
        if nonce_bytes < 1 or nonce_bytes > 128:
            raise ValueError(f"a nonce of {nonce_bytes} bytes (1 to 128)")
        cdef void* ctx = _evp.ctx_new()
        if ctx == NULL:
            raise MemoryError("EVP_CIPHER_CTX_new")
        cdef _init_t init = _evp.encrypt_init if encrypting else _evp.decrypt_init
        if (init(ctx, cipher, NULL, NULL, NULL) != 1
                or _evp.ctrl(ctx, _GCM_SET_IVLEN, <int>nonce_bytes, NULL) != 1
                or init(ctx, NULL, NULL, key, NULL) != 1):
            _evp.ctx_free(ctx)
            raise RuntimeError("OpenSSL refused the AES-GCM key or nonce length")
        return ctx

    cdef GcmCtx _borrow(self, bint encrypting, Py_ssize_t nonce_bytes) except *:
        """What to seal or open with for this key and nonce length, the caller's alone
        until it hands it to :meth:`_give_back` (with the GIL held, as here): the
        libsodium key state for 12-byte nonces when there is one (shared: any number of
        threads may use it at once), else the OpenSSL context kept for 12-byte nonces
        when it is free, else a new one."""
        cdef GcmCtx ctx
        ctx.evp = NULL
        ctx.sodium = NULL
        if nonce_bytes == 12:
            if self._state != NULL:
                ctx.sodium = self._state
                return ctx
            if encrypting and self._sealing != NULL:
                ctx.evp, self._sealing = self._sealing, NULL
                return ctx
            if not encrypting and self._opening != NULL:
                ctx.evp, self._opening = self._opening, NULL
                return ctx
        ctx.evp = self._context(encrypting, nonce_bytes)
        return ctx

    cdef GcmCtx _another(self, GcmCtx ctx, bint encrypting, Py_ssize_t nonce_bytes) except *:
        """One more of what :meth:`_borrow` gave as ``ctx``, for another thread: the same
        libsodium state, or a new OpenSSL context (handed to :meth:`_give_back`)."""
        if ctx.sodium != NULL:
            return ctx
        ctx.evp = self._context(encrypting, nonce_bytes)
        return ctx

    cdef void _give_back(self, GcmCtx ctx, bint encrypting, Py_ssize_t nonce_bytes):
        """Keep an OpenSSL context for the next 12-byte-nonce call when none is kept,
        else free it (a libsodium state stays with the key)."""
        if ctx.evp == NULL:
            return
        if nonce_bytes == 12 and encrypting and self._sealing == NULL:
            self._sealing = ctx.evp
        elif nonce_bytes == 12 and not encrypting and self._opening == NULL:
            self._opening = ctx.evp
        else:
            _evp.ctx_free(ctx.evp)

    def encrypt(self, bytes nonce not None, data, aad):
        """``data`` encrypted, followed by its 16-byte tag."""
        cdef const unsigned char[:] plain = data
        cdef bytes a = bytes(aad) if aad is not None else b""
        cdef Py_ssize_t n = plain.shape[0]
        cdef bytes out = PyBytes_FromStringAndSize(NULL, n + GCM_TAG_BYTES)
        cdef unsigned char* o = <unsigned char*>PyBytes_AS_STRING(out)
        cdef GcmCtx ctx = self._borrow(True, PyBytes_GET_SIZE(nonce))
        cdef int ok = _gcm_seal(&ctx, <const unsigned char*>PyBytes_AS_STRING(nonce),
                                &plain[0] if n else <const unsigned char*>o, n,
                                <const unsigned char*>PyBytes_AS_STRING(a),
                                PyBytes_GET_SIZE(a), o, o + n)
        self._give_back(ctx, True, PyBytes_GET_SIZE(nonce))
        if not ok:
            raise RuntimeError("OpenSSL failed to encrypt")
        return out

    def decrypt(self, bytes nonce not None, data, aad):
        """The plaintext of ``data`` (ciphertext and tag); ValueError if it does not open."""
        cdef const unsigned char[:] sealed = data
        cdef bytes a = bytes(aad) if aad is not None else b""
        cdef Py_ssize_t n = sealed.shape[0] - GCM_TAG_BYTES
        if n < 0:
            raise ValueError("the ciphertext is shorter than a tag")
        cdef bytes out = PyBytes_FromStringAndSize(NULL, n)
        cdef GcmCtx ctx = self._borrow(False, PyBytes_GET_SIZE(nonce))
        cdef int ok = _gcm_open(&ctx, <const unsigned char*>PyBytes_AS_STRING(nonce),
                                &sealed[0], n, &sealed[0] + n,
                                <const unsigned char*>PyBytes_AS_STRING(a),
                                PyBytes_GET_SIZE(a), <unsigned char*>PyBytes_AS_STRING(out))
        self._give_back(ctx, False, PyBytes_GET_SIZE(nonce))
        if not ok:
            raise ValueError("the ciphertext does not open under this key, nonce and aad")
        return out


cdef int _gcm_seal(const GcmCtx* c, const unsigned char* nonce, const unsigned char* plain,
                   Py_ssize_t n, const unsigned char* aad, Py_ssize_t aad_len,
                   unsigned char* out, unsigned char* tag) noexcept nogil:
    """Encrypt ``n`` bytes of ``plain`` into ``out`` and the tag into ``tag``: 1, or 0."""
    cdef int written = 0
    if n > 0x7FFFFFFF or aad_len > 0x7FFFFFFF:
        return 0
    if c.sodium != NULL:
        return _sodium.seal(out, tag, NULL, plain, <unsigned long long>n, aad,
                            <unsigned long long>aad_len, NULL, nonce, c.sodium) == 0
    cdef void* ctx = c.evp
    if _evp.encrypt_init(ctx, NULL, NULL, NULL, nonce) != 1:
        return 0
    if aad_len and _evp.encrypt_update(ctx, NULL, &written, aad, <int>aad_len) != 1:
        return 0
    if n and _evp.encrypt_update(ctx, out, &written, plain, <int>n) != 1:
        return 0
    if _evp.encrypt_final(ctx, out + written, &written) != 1:
        return 0
    return _evp.ctrl(ctx, _GCM_GET_TAG, GCM_TAG_BYTES, tag) == 1


cdef int _gcm_open(const GcmCtx* c, const unsigned char* nonce, const unsigned char* sealed,
                   Py_ssize_t n, const unsigned char* tag, const unsigned char* aad,
                   Py_ssize_t aad_len, unsigned char* out) noexcept nogil:
    """Decrypt ``n`` bytes of ``sealed`` into ``out``, checking ``tag``: 1, or 0."""
    cdef int written = 0
    if n > 0x7FFFFFFF or aad_len > 0x7FFFFFFF:
        return 0
    if c.sodium != NULL:
        return _sodium.open(out, NULL, sealed, <unsigned long long>n, tag, aad,
                            <unsigned long long>aad_len, nonce, c.sodium) == 0
    cdef void* ctx = c.evp
    if _evp.decrypt_init(ctx, NULL, NULL, NULL, nonce) != 1:
        return 0
    if aad_len and _evp.decrypt_update(ctx, NULL, &written, aad, <int>aad_len) != 1:
        return 0
    if n and _evp.decrypt_update(ctx, out, &written, sealed, <int>n) != 1:
        return 0
    if _evp.ctrl(ctx, _GCM_SET_TAG, GCM_TAG_BYTES, <void*>tag) != 1:
        return 0
    return _evp.decrypt_final(ctx, out + written, &written) == 1


cdef AesGcm _gcm_of(object cipher, str method):
    """The ``AesGcm`` whose bound ``method`` ``cipher`` is, or that ``cipher`` is; else None."""
    if type(cipher) is AesGcm:
        return <AesGcm>cipher
    owner = getattr(cipher, "__self__", None)
    if type(owner) is AesGcm and getattr(cipher, "__name__", None) == method:
        return <AesGcm>owner
    return None
