"""The backend registry: what each backend runs, and which one runs a call.

A backend is one module that builds a :class:`Backend` (its name, priority, the ops it has
kernels for, the devices / dtypes / call features it supports, the package it needs) and passes
it to :func:`register_backend` at import. The built-ins are the modules of
:mod:`retrofit.ops.backends`, imported on first use; other packages' backends are found the way
every registry of retrofit finds its entries (:mod:`retrofit.plugins`: the same call, or the
``retrofit.backends`` entry-point group). The ops in :mod:`retrofit.ops` are
:class:`Op` objects: each call is described (:class:`Call`: device, dtype, features), a backend
is chosen by :func:`resolve`, and that backend's kernel runs with the call's arguments.

Choosing (first that is set wins): the op's ``backend=`` argument, then
:func:`set_default_backend` / :func:`use_backend` (what a CLI ``--backend`` flag sets), then the
``RETROFIT_BACKEND`` environment variable, then ``auto``. A request is one name or a comma list
(``fla,torch`` = fla for the ops fla has kernels for, torch for the rest): each op takes the
first listed backend that has a kernel for it, and ``auto`` if none does.

* ``auto`` tries the backends with a kernel for the op, highest priority first, skipping those
  that cannot run the call or that only run it on request (the reason is logged at DEBUG).
* A requested backend that cannot run the call (wrong device or dtype, package missing,
  unsupported feature) warns once with the reason and runs what ``auto`` picks - unless
  requests are strict (:func:`strict_backends`, ``RETROFIT_BACKEND_STRICT=1``): then it is a
  :class:`BackendUnavailable` error with that reason (what a test of a named backend needs:
  a missing package must fail it, not compare the torch kernel with itself).
* An unknown name is a :class:`~retrofit.errors.SpecError` naming the registered backends.
* The first call of each (op, backend, device, dtype) is logged at INFO:
  ``retrofit.ops: <op> runs on the <backend> backend (<device>, <dtype>)``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import logging
import os
from typing import Any, Callable, Iterator, Mapping

import torch

from retrofit.errors import SpecError
from retrofit.plugins import Discovery, check_name, import_submodules

__all__ = [
    "AUTO",
    "ENV_VAR",
    "STRICT_ENV_VAR",
    "Backend",
    "BackendUnavailable",
    "Call",
    "Kernel",
    "Op",
    "available_backends",
    "backend_names",
    "get_backend",
    "get_default_backend",
    "is_installed",
    "register_backend",
    "resolve",
    "resolve_backend",
    "set_default_backend",
    "strict_backends",
    "unregister_backend",
    "use_backend",
]

logger = logging.getLogger("retrofit.ops.backends")

ENV_VAR = "RETROFIT_BACKEND"
STRICT_ENV_VAR = "RETROFIT_BACKEND_STRICT"
AUTO = "auto"


class BackendUnavailable(SpecError):
    """A strictly requested backend cannot run a call (the message says why and how to install it)."""


@dataclasses.dataclass(frozen=True)
class Call:
    """What a backend needs to know about one call of an op to say whether it can run it."""

    device: torch.device
    dtype: torch.dtype
    key_padding_mask: bool = False  # a key padding mask was passed
    head_dim: int | None = None  # q/k head dim (sliding window)
    value_dim: int | None = None  # v head dim (sliding window)
    mixed_dtypes: bool = False  # q, k, v differ in dtype
    needs_grad: bool = False  # autograd will differentiate the call (ops whose description sets it)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A backend's implementation of one op; ``auto=False``: run only when the backend is requested."""

    fn: Callable[..., Any]
    auto: bool = True


@dataclasses.dataclass(frozen=True)
class Backend:
    """One backend: the ops it runs (``kernels``) and the calls it can run.

    ``priority``: higher is tried first by ``auto``. ``package``: a module that must import
    (``install_hint`` says how to get it). ``devices`` / ``dtypes``: ``None`` = any.
    ``auto_dtypes``: the dtypes ``auto`` may pick it for (default: all of ``dtypes``), with
    ``auto_dtype_note`` saying why the others need a request. ``check(op, call)``: the reason
    a call's features rule the backend out, or None.
    """

    name: str
    priority: int
    kernels: Mapping[str, Kernel | Callable[..., Any]]
    package: str | None = None
    install_hint: str = ""
    devices: frozenset[str] | None = None
    dtypes: frozenset[torch.dtype] | None = None
    auto_dtypes: frozenset[torch.dtype] | None = None
    auto_dtype_note: str = ""
    check: Callable[[str, Call], str | None] | None = None

    def kernel(self, op: str) -> Kernel | None:
        k = self.kernels.get(op)
        return k if k is None or isinstance(k, Kernel) else Kernel(k)

    def why_not(self, op: str, call: Call, *, auto: bool = False) -> str | None:
        """None if this backend can run ``call`` of ``op``, else the reason (``auto``: its stricter rules)."""
        kernel = self.kernel(op)
        if kernel is None:
            return f"{self.name} has no {op} kernel"
        if auto and not kernel.auto:
            return f"{self.name} runs {op} only on request"
        if self.devices is not None and call.device.type not in self.devices:
            wanted = "/".join(d.upper() if d == "cuda" else d for d in sorted(self.devices))
            return f"{self.name} needs {wanted} tensors (got {call.device.type})"
        if not (_installed_constant(self.name) if torch.compiler.is_compiling() else is_installed(self.name)):
            return f"{self.name} is not installed (pip install 'retrofit[gpu]' or {self.install_hint or self.package})"
        if self.dtypes is not None and call.dtype not in self.dtypes:
            return f"{self.name} kernels take {_dtypes(self.dtypes)}, not {call.dtype}"
        if auto and self.auto_dtypes is not None and call.dtype not in self.auto_dtypes:
            return f"{_dtype(call.dtype)} stays off {self.name} unless it is requested ({self.auto_dtype_note})"
        return self.check(op, call) if self.check is not None else None


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _dtypes(dtypes: frozenset[torch.dtype]) -> str:
    return "/".join(sorted(_dtype(d) for d in dtypes))


# --------------------------------------------------------------------------------------
# registering

_backends: dict[str, Backend] = {}
# the built-ins: every module of this package, each registering itself at import
_FOUND = Discovery("retrofit.backends", lambda: import_submodules(__name__.rpartition(".")[0]))


def register_backend(backend: Backend, *, replace: bool = False) -> Backend:
    """Add a backend; its module calls this at import. Returns the backend. A name already registered
    (a built-in's included) is a ``RetrofitError`` unless ``replace=True`` (the rule of every registry:
    :mod:`retrofit.plugins`)."""
    _FOUND.builtins()
    if not backend.name or backend.name == AUTO or "," in backend.name or backend.name != backend.name.lower():
        raise ValueError(f"bad backend name {backend.name!r}: lower case, not 'auto', no commas")
    check_name("backend", backend.name, _backends.get(backend.name), backend, replace=replace)
    _backends[backend.name] = backend
    is_installed.cache_clear()
    _resolved.clear()
    return backend


def unregister_backend(name: str) -> None:
    """Remove a backend (tests)."""
    _backends.pop(name, None)
    is_installed.cache_clear()
    _resolved.clear()


def get_backend(name: str) -> Backend:
    """The registered backend called ``name`` (KeyError if none)."""
    _FOUND.everything()
    return _backends[name]


def backend_names() -> tuple[str, ...]:
    """Registered backends, highest priority first."""
    _FOUND.everything()
    return tuple(b.name for b in sorted(_backends.values(), key=lambda b: -b.priority))


@torch.compiler.assume_constant_result
def _installed_constant(backend: str) -> bool:
    """:func:`is_installed` as torch.compile sees it: called once while tracing, its answer baked into the graph
    (tracing the import inside would break the graph)."""
    return is_installed(backend)


@functools.lru_cache(maxsize=None)
def is_installed(backend: str) -> bool:
    """Whether the backend's package imports (cached; a broken CUDA build counts as missing)."""
    _FOUND.everything()
    b = _backends.get(backend)
    if b is None:
        return False
    if b.package is None:
        return True
    try:
        importlib.import_module(b.package)
    except Exception as exc:  # ImportError, or an undefined-symbol error from a mismatched build
        logger.debug("retrofit.ops: backend %r unavailable (%s: %s)", backend, type(exc).__name__, exc)
        return False
    return True


def available_backends() -> dict[str, bool]:
    """``{backend: installed}`` for reporting (``retrofit bench`` writes it into results.json)."""
    return {name: is_installed(name) for name in backend_names()}


# --------------------------------------------------------------------------------------
# requests

_default_backend: str | None = None


def _parse(request: str | None) -> tuple[str, ...]:
    _FOUND.everything()
    if request is None:
        return ()
    names = tuple(n.strip().lower() for n in str(request).split(",") if n.strip())
    bad = [n for n in names if n != AUTO and n not in _backends]
    if bad:
        raise SpecError(
            f"unknown attention backend {', '.join(map(repr, bad))}: choose from "
            f"{', '.join((AUTO,) + backend_names())} (or a comma list such as 'fla,flash'), "
            f"via backend=, --backend or ${ENV_VAR}"
        )
    return names


def set_default_backend(name: str | None) -> None:
    """Process-wide request (what ``--backend`` sets); ``None`` or ``"auto"`` clears it."""
    global _default_backend
    names = _parse(name)
    _default_backend = None if not names or names == (AUTO,) else ",".join(names)


def get_default_backend() -> str:
    """The request in force without a ``backend=`` argument: set_default_backend, env var, or auto."""
    return _default_backend or os.environ.get(ENV_VAR, "").strip() or AUTO


_strict: bool = False


def _is_strict() -> bool:
    """Whether a requested backend that cannot run a call is an error (strict_backends or the env var)."""
    return _strict or os.environ.get(STRICT_ENV_VAR, "").strip().lower() in ("1", "true", "yes")


@contextlib.contextmanager
def strict_backends(on: bool = True) -> Iterator[None]:
    """``with strict_backends(): ...`` - a requested backend that cannot run a call raises
    :class:`BackendUnavailable` instead of falling back to what ``auto`` picks."""
    global _strict
    old = _strict
    _strict = on
    try:
        yield
    finally:
        _strict = old


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """``with use_backend("torch"): ...`` - temporary process-wide request."""
    global _default_backend
    old = _default_backend
    set_default_backend(name)
    try:
        yield
    finally:
        _default_backend = old


# --------------------------------------------------------------------------------------
# choosing

_logged: set[tuple] = set()


def _log_once(level: int, key: tuple, msg: str, *args: Any) -> None:
    # a call torch.compile traces chooses its backend like an eager one but cannot log (dynamo refuses
    # logging in a graph); the next eager call of the op logs the choice
    if torch.compiler.is_compiling() or key in _logged:
        return
    _logged.add(key)
    logger.log(level, msg, *args)


def _reset_log_memory() -> None:
    """Forget which choices were logged, and the choices themselves, so they are made and logged again (tests)."""
    _logged.clear()
    _resolved.clear()


def _auto(op: str, call: Call, *, quiet: bool = False) -> Backend:
    """The highest-priority backend that runs ``call`` under auto's rules (``quiet``: log no skips)."""
    _FOUND.everything()
    candidates = sorted((b for b in _backends.values() if op in b.kernels), key=lambda b: -b.priority)
    for b in candidates:
        reason = b.why_not(op, call, auto=True)
        if reason is None:
            return b
        if not quiet:
            _log_once(logging.DEBUG, ("auto-skip", op, b.name, reason), "retrofit.ops: %s: not using %s: %s",
                      op, b.name, reason)
    raise RuntimeError(f"no registered backend can run {op} on {call.device.type} {_dtype(call.dtype)}")


# (op, call, request, process default, env var) -> the backend chosen: a decoding step calls a few ops
# per layer per token, and choosing afresh costs ~25 us per call on a CPU (parsing the request,
# sorting candidates, checking each). Cleared whenever a backend is (un)registered.
_resolved: dict[tuple, Backend] = {}


def resolve(op: str, call: Call, requested: str | None = None) -> Backend:
    """The backend that runs ``call`` of ``op``; ``requested`` None or "auto": the default request."""
    if torch.compiler.is_compiling():  # traced: chosen afresh, so the graph guards on the backends, not on this memo
        return _resolve(op, call, requested)
    key = (op, call, requested, _default_backend, os.environ.get(ENV_VAR), _is_strict())
    chosen = _resolved.get(key)
    if chosen is None:
        chosen = _resolved[key] = _resolve(op, call, requested)
    return chosen


def _resolve(op: str, call: Call, requested: str | None) -> Backend:
    names = _parse(requested)
    if not names or names == (AUTO,):
        names = _parse(get_default_backend())
    explicit = next((_backends[n] for n in names if n != AUTO and op in _backends[n].kernels), None)
    chosen = None
    if explicit is not None:
        reason = explicit.why_not(op, call)
        if reason is None:
            chosen = explicit
        elif _is_strict():
            raise BackendUnavailable(f"{op} requested the {explicit.name} backend but {reason} (strict backend requests)")
        else:
            chosen = _auto(op, call, quiet=True)  # the warning below says why
            _log_once(logging.WARNING, ("fallback", op, explicit.name, reason),
                      "retrofit.ops: %s requested the %s backend but %s; using %s", op, explicit.name, reason, chosen.name)
    else:
        chosen = _auto(op, call)
    _log_once(logging.INFO, ("ran", op, chosen.name, call.device.type, call.dtype),
              "retrofit.ops: %s runs on the %s backend (%s, %s)", op, chosen.name, call.device.type, _dtype(call.dtype))
    return chosen


def _has_kernel(op: str) -> bool:
    _FOUND.everything()
    return any(op in b.kernels for b in _backends.values())


def resolve_backend(
    op: str,
    device: torch.device | str,
    dtype: torch.dtype,
    requested: str | None = None,
    **features: Any,
) -> str:
    """Name of the backend that would run a call of ``op`` (an op name) on ``device``/``dtype``.

    ``features``: the :class:`Call` fields (key_padding_mask, head_dim, value_dim, mixed_dtypes, needs_grad).
    """
    if not _has_kernel(op):
        raise ValueError(f"unknown op {op!r}")
    return resolve(op, Call(torch.device(device), dtype, **features), requested).name


# --------------------------------------------------------------------------------------
# the dispatched ops


class Op:
    """A dispatched op: ``op(*args, backend="auto", **kwargs)`` runs the chosen backend's kernel.

    ``torch_kernel``: the pure-PyTorch kernel, which gives the op its name, signature and
    docstring and is the ``torch`` backend's implementation. ``describe(*args, **kwargs)`` ->
    :class:`Call` for the same arguments.
    """

    def __init__(self, torch_kernel: Callable[..., Any], describe: Callable[..., Call]):
        self.name = torch_kernel.__name__
        self.torch_kernel = torch_kernel
        self.describe = describe
        functools.update_wrapper(self, torch_kernel)
        del self.__wrapped__  # the signature below is the op's, not the torch kernel's
        sig = inspect.signature(torch_kernel)
        backend = inspect.Parameter("backend", inspect.Parameter.KEYWORD_ONLY, default=AUTO, annotation="str | None")
        params = list(sig.parameters.values())
        if params and params[-1].kind is inspect.Parameter.VAR_KEYWORD:
            params.insert(len(params) - 1, backend)
        else:
            params.append(backend)
        self.__signature__ = sig.replace(parameters=params)
        self.__doc__ = f"Dispatched op (see retrofit.ops.backends; ``backend=`` picks one).\n\n{torch_kernel.__doc__ or ''}"

    def __call__(self, *args: Any, backend: str | None = AUTO, **kwargs: Any) -> Any:
        chosen = resolve(self.name, self.describe(*args, **kwargs), backend)
        return chosen.kernel(self.name).fn(*args, **kwargs)

    def kernel(self, backend: str) -> Callable[..., Any]:
        """The ``backend`` backend's implementation of this op (no dispatch)."""
        k = get_backend(backend).kernel(self.name)
        if k is None:
            raise KeyError(f"backend {backend!r} has no {self.name} kernel")
        return k.fn

    def __repr__(self) -> str:
        return f"<retrofit op {self.name}>"
