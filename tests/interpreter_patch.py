"""Three costs of Triton's interpreter that the CPU suite's many small kernel calls pay without
learning anything from them. `install()` removes them; the interpreted math is unchanged. Without
the interpreter's private names (another Triton) it leaves each as it is.

- It re-patches `triton.language` (an `inspect.getmembers` walk of the module and its tensor class)
  on every call of a `@triton.jit` helper inside a kernel, although the kernel's own launch has
  already patched it and will restore it at its end: a third of an interpreted call's time. A
  nested call skips the walk when every language module the helper sees is already patched.
- It computes an overflow check of every 8-32-bit integer add, subtract and multiply (casts to
  int64 and two compares per operation), then drops it: the device assert it feeds is emitted only
  when the interpreter's own options say ``debug``, which Triton never sets. That is a fifth of the
  suite's interpreted time for nothing. One test switches the check and the asserts on and runs a
  whole call under them (test_triton_interpret.py).
- It rebuilds a dict of numpy dtypes on every value it converts; the answer is memoised here."""
from __future__ import annotations

import dataclasses
import inspect
import os


def install() -> bool:
    try:
        from triton.runtime import interpreter as interp
    except Exception:  # no Triton, or one whose interpreter does not import on this machine
        return False
    original = getattr(interp, "_patch_lang", None)
    scope_cls = getattr(interp, "_LangPatchScope", None)
    tl = getattr(interp, "tl", None)
    if original is None or scope_cls is None or tl is None or getattr(original, "_pisa_fast", False):
        return False
    patched: set[int] = set()  # ids of the language modules the running launch has patched
    langs_of: dict = {}  # (id of a module's globals, their count) -> its language modules' ids

    def _langs(fn):
        g = fn.__globals__
        key = (id(g), len(g))
        if key not in langs_of:
            langs_of[key] = frozenset(id(v) for v in g.values() if inspect.ismodule(v) and v in (tl, tl.core))
        return langs_of[key]

    def fast_patch_lang(fn):
        langs = _langs(fn)
        if langs and langs <= patched:
            return scope_cls()  # nothing to restore: the launch's own scope restores it all
        scope = original(fn)
        patched.update(langs)
        restore = scope.restore

        def restore_all():
            restore()
            patched.clear()

        scope.restore = restore_all
        return scope

    fast_patch_lang._pisa_fast = True
    interp._patch_lang = fast_patch_lang

    np_dtype = getattr(interp, "_get_np_dtype", None)
    if np_dtype is not None:
        np_dtypes: dict = {}

        def fast_np_dtype(tt_dtype):
            # a block's numpy dtype is its element's (pointers: uint64, as the original says)
            key = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
            if isinstance(key, tl.pointer_type):  # unhashable
                return np_dtype(key)
            if key not in np_dtypes:
                np_dtypes[key] = np_dtype(key)
            return np_dtypes[key]

        interp._get_np_dtype = fast_np_dtype

    builder = getattr(interp, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if getattr(options, "sanitize_overflow", False) and not options.debug:
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)
    return True


# Imported where kernels run interpreted: the suite's conftest, and the server the context-parallel
# tests fork their ranks from (tests/local_ranks.py), whose ranks never see the conftest.
if os.environ.get("TRITON_INTERPRET") == "1":
    install()
