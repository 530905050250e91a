"""Compiled kernels for the loops numpy cannot express in a few whole-array passes.

Why: a binary search, a hash-table probe or a merge is a loop whose every step depends on data.
In numpy each step becomes a *round* of ~15 whole-array operations over the keys still searching,
so a search over rows of 10^6 entries costs ~20 rounds of Python-dispatched passes (docs/model.md,
"Rows at scale", measured the rounds' overhead, not cache misses, as the cost). Compiled, the same
loop walks each query once; sorted queries of one row gallop from the previous answer instead of
searching the whole row (measured 25 vs 347 ns per query on 10^6 sorted queries into 10^7 keys).

How: numba (LLVM) compiles each kernel **eagerly** from an explicit signature when its module is
imported, so no first call in a hot path ever waits for a compiler; the machine code is cached on
disk (``__pycache__`` beside the source, else numba's per-user cache, or ``$NUMBA_CACHE_DIR``: the
systemd unit points it at the daemon's cache directory) and loaded in milliseconds by later
processes; where no location is writable the kernels compile uncached, with one warning. Kernels hold no
Python objects, release the GIL (``nogil``) and keep IEEE float semantics (no ``fastmath``: a float32
sum must come out bit for bit what numpy's left fold gives). ``boundscheck`` is off: a kernel's
caller validates indices the way the numpy code it replaces did.

A kernel is a plain function of arrays and scalars; declare it as::

    @kernel("void(uint8[:], int64[:])")
    def _fill(out, idx): ...

and with several signatures (one machine-code version each, the call picks by its arguments' types)
where one loop serves several dtypes: ``@kernel("void(uint8[:])", "void(float32[:])")``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar, cast

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils as _cgutils
from numba.extending import intrinsic

__all__ = ["kernel", "prefetch", "readonly"]

cgutils: Any = _cgutils  # partly annotated: its helpers are untyped

F = TypeVar("F", bound=Callable[..., Any])


def readonly(dtype: str) -> str:
    """The type string of a read-only, contiguous 1-d array of ``dtype`` (numba's name: ``uint8``):
    a kernel's input arrays are declared so, since a writable array converts to one but not back
    (a snapshot's mapped base or a decoded batch is read-only, and must not be copied to be read)."""
    return f"Array({dtype}, 1, 'C', readonly=True)"


_warned = False


def _warn_uncached(exc: RuntimeError) -> None:
    global _warned
    if not _warned:
        _warned = True
        logging.getLogger(__name__).warning(
            "compiled kernels are not cached (%s): every start compiles them; set NUMBA_CACHE_DIR to a "
            "writable directory", exc)


def kernel(*signatures: str) -> Callable[[F], F]:
    """Compile the decorated function now, for each of ``signatures`` (numba's type strings), cached
    on disk."""

    def wrap(fn: F) -> F:
        options: dict[str, Any] = {"nogil": True, "boundscheck": False, "fastmath": False, "error_model": "numpy"}
        try:
            compiled = njit(list(signatures), cache=True, **options)(fn)
        except RuntimeError as exc:  # no writable cache location (read-only package, no home)
            if "locator" not in str(exc):
                raise
            _warn_uncached(exc)
            compiled = njit(list(signatures), **options)(fn)
        return cast(F, compiled)

    return wrap


def _prefetch_typer(typingctx: Any, array: Any, index: Any) -> Any:
    """``llvm.prefetch`` of ``array[index]`` (read, into all cache levels): a hint, no fault, no effect
    on any value. Lets a kernel ask for the memory it will read a few steps ahead (a key index's
    probe walk, a gather of scattered slices), so the cache misses of data larger than the cache
    overlap instead of coming one after another."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]])
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(array, index), codegen


#: ``prefetch(array, index)`` in a kernel (``_prefetch_typer`` says what it does).
prefetch: Any = intrinsic(_prefetch_typer)
