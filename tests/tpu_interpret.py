"""The TPU kernel of rope_and_cache run on the CPU by Pallas' TPU interpreter (tests only).

`tpu_kernel_on_cpu()` makes the op's CPU lowering the TPU backend's kernel (backends/tpu.kernel_fn
with `interpret=pltpu.InterpretParams(...)`, after the backend's own refusals) for the duration of a
`with` block, through the package's lowering policy (primitive.kernel_lowering), then puts the C++
handler's lowering back. jax's caches are cleared on the way in and out, so no executable compiled
with one lowering is reused under the other. The package itself never selects interpret mode.
"""

from __future__ import annotations

import contextlib
import functools
import types

import jax
from jax.experimental.pallas import tpu as pltpu
from jax.interpreters import mlir

from jax_rope_cache import backends, primitive
from jax_rope_cache.backends import tpu

NAME = "TPU (Pallas TPU interpret mode on the CPU)"
# DMAs run when started ("eager"): a copy started before its source is written reads stale data.
# tests/test_tpu_kernel.py also runs the late order ("on_wait") with the race detector.
DEFAULT_PARAMS = pltpu.InterpretParams(dma_execution_mode="eager")


def lower_interpreted(ctx, args, spec, *, params):
    """tpu.lower with the kernel interpreted. The interpreter's callbacks are ordered effects,
    which the op's primitive does not declare: the kernel gets a token chain of its own."""
    tpu.refuse(spec)
    fn = tpu.kernel_fn(spec, interpret=params)
    effects = list(jax.make_jaxpr(fn)(*ctx.avals_in).effects)
    return mlir.lower_fun(fn, multiple_results=True)(ctx.replace(tokens_in=mlir.TokenSet.create(effects)), *args)


def interpreted_backend(params=None):
    """A backend with the TPU kernel's lowering in interpret mode, for the CPU platform."""
    params = DEFAULT_PARAMS if params is None else params
    return types.SimpleNamespace(PLATFORM="cpu", NAME=NAME, SUPPORTS=tpu.SUPPORTS, missing=tpu.missing,
                                 lower=functools.partial(lower_interpreted, params=params))


def _fresh():
    jax.clear_caches()
    primitive._eager_callable.cache_clear()


@contextlib.contextmanager
def tpu_kernel_on_cpu(params=None):
    _fresh()
    mlir.register_lowering(primitive.rope_cache_p, primitive.kernel_lowering(interpreted_backend(params)),
                           platform="cpu")
    try:
        yield
    except BaseException:
        pltpu.reset_tpu_interpret_mode_state()  # the interpreter's state after a failed kernel
        raise
    finally:
        mlir.register_lowering(primitive.rope_cache_p, primitive.kernel_lowering(backends.cpu), platform="cpu")
        _fresh()
