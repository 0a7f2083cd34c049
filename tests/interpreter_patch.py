"""Triton's interpreter re-patches `triton.language` (an `inspect.getmembers` walk of the module and
its tensor class) on every call of a `@triton.jit` helper inside a kernel, although the kernel's own
launch has already patched it and will restore it at its end: a third of an interpreted call's time.
`install()` makes a nested call skip the walk when every language module the helper sees is already
patched by the running launch; the interpreted math is unchanged. Without the interpreter's private
names (another Triton) it does nothing."""
from __future__ import annotations

import inspect


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

    def _langs(fn):
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

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
    return True
