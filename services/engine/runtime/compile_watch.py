"""Names every Triton compile that happens after start-up: the warm-up and the graph capture are meant to
compile every kernel specialization a request can meet (docs/serving.md "Start-up"), so a compile while
serving is a miss of theirs that one request paid for (a Triton compile is ~0.3-1.5 s of its TTFT).

``CompileWatch.start()`` (the runner calls it once start-up is done, CUDA only; ``ModelRunner.close``
stops it) chains Triton's ``knobs.runtime.jit_cache_hook`` (called before a compile: an in-memory cache
miss) and ``jit_post_compile_hook`` (after it). The hooks are process-wide, so they are installed once
for all the watches started: each compile is logged once as a warning, one line, with its seconds and
``describe_compile``'s description, and kept in the ``compiles`` of every started watch (the GPU test
asserts they stay empty under random traffic). Triton versions without these knobs (< 3.4) are not
watched (logged once).

Why not Triton's own ``repr`` kwarg: it zips the parameters with ``key[1]``, and the key is a string
(3.6 to 3.8 at least), so it names the first parameter only, with "(" for its type.
"""

from __future__ import annotations

import time

from services.common.logging import get_logger

log = get_logger("runner")

_watches: list[CompileWatch] = []  # started, not stopped; the hooks are installed while there are any
_before_ours: tuple = (None, None)  # Triton's hooks as they were when ours went in (put back after the last stop)
_t0: dict[str, float] = {}  # cache key -> when its compile started


def _path_name(names: list[str], path) -> str:
    """A constexpr/attribute path (a tuple of argument indices; more than one inside tuple arguments) as
    ``name[i]...``."""
    path = tuple(path) if isinstance(path, (tuple, list)) else (path,)
    if not path or not isinstance(path[0], int) or path[0] >= len(names):
        return str(path)
    return names[path[0]] + "".join(f"[{i}]" for i in path[1:])


def _value(v) -> str:
    """A constexpr's value, short: a jitted function by its name, a dtype as Triton prints it."""
    fn = getattr(v, "fn", None)  # a JITFunction passed as constexpr
    if fn is not None and hasattr(fn, "__qualname__"):
        return fn.__qualname__
    text = str(getattr(v, "value", v))  # tl.constexpr wraps its value
    return text if len(text) <= 40 else text[:37] + "..."


def _attrs(specs) -> str:
    """The specializations Triton keys on (CUDA: ``[["tt.divisibility", 16]]`` -> "%16", the pointer or int
    is a multiple of 16); others as name=value."""
    out = []
    for spec in specs or []:
        if isinstance(spec, (list, tuple)) and len(spec) == 2:
            name, val = spec
            out.append(f"%{val}" if name == "tt.divisibility" else f"{str(name).removeprefix('tt.')}={val}")
    return " ".join(out)


def describe_compile(kw: dict) -> str:
    """One line naming a compile from the hook's keywords: ``module.kernel[num_warps=..](arg: type %16, ...,
    BLOCK=64)`` (argument types from ``compile["signature"]``, constexpr values from ``compile["constants"]``,
    ``%16``: the argument is divisible by 16, from ``compile["configs"][0]``). Any key Triton leaves out is
    skipped; with no signature at all, Triton's ``repr``."""
    info = kw.get("compile") or {}
    fn = kw.get("fn")
    name = getattr(fn, "name", None) or str(kw.get("repr", "?")).split("[", 1)[0]
    module = getattr(fn, "module", None)
    module = getattr(module, "__name__", module)  # a module object, or its name
    if module:
        name = f"{str(module).rsplit('.', 1)[-1]}.{name}"
    options = ", ".join(f"{k}={info[k]}" for k in ("num_warps", "num_stages", "num_ctas") if k in info)
    signature = info.get("signature")
    if not isinstance(signature, dict):
        return str(kw.get("repr", name))
    names = list(signature)
    constants = {_path_name(names, p): _value(v) for p, v in (info.get("constants") or {}).items()}
    configs = info.get("configs") or [{}]
    attrs = {_path_name(names, p): _attrs(s) for p, s in (configs[0] if isinstance(configs[0], dict) else {}).items()}
    args = []
    for arg, ty in signature.items():
        if arg in constants or ty == "constexpr":
            args.append(f"{arg}={constants.get(arg, '?')}")
        else:
            args.append(" ".join(filter(None, (f"{arg}: {ty}", attrs.get(arg, "")))))
    args += [f"{k}={v}" for k, v in constants.items() if k not in signature]  # inside tuple arguments
    return f"{name}[{options}]({', '.join(args)})"


def _before(**kw):
    _t0[str(kw.get("key"))] = time.perf_counter()
    prev = _before_ours[0]
    return prev(**kw) if prev is not None else None  # a True would skip the compile


def _after(**kw):
    seconds = time.perf_counter() - _t0.pop(str(kw.get("key")), time.perf_counter())
    try:
        kernel = describe_compile(kw)
    except Exception as exc:  # noqa: BLE001 - a Triton with other kwargs must not fail the compile
        kernel = f"{kw.get('repr', '?')} (not described: {type(exc).__name__}: {exc})"
    for watch in _watches:
        watch.compiles.append({"kernel": kernel, "seconds": seconds})
    if _watches:
        log.warning("Triton compiled %s while serving (%.2f s on a request's path: a specialization the start-up "
                    "warm-up missed)", kernel, seconds)
    prev = _before_ours[1]
    return prev(**kw) if prev is not None else None


class CompileWatch:
    def __init__(self) -> None:
        self.compiles: list[dict] = []  # {"kernel": description, "seconds": s} per compile since start()

    @property
    def active(self) -> bool:
        return self in _watches

    def start(self) -> None:
        """Watch from now on; the first watch started installs the hooks (keeping any hook already there)."""
        global _before_ours
        try:
            from triton import knobs
        except ImportError:
            log.info("this Triton has no compile hooks (knobs): compiles after start-up are not reported")
            return
        if self.active:
            return
        if not _watches:
            rt = knobs.runtime
            _before_ours = (rt.jit_cache_hook, rt.jit_post_compile_hook)
            rt.jit_cache_hook, rt.jit_post_compile_hook = _before, _after
        _watches.append(self)

    def stop(self) -> None:
        """Stop watching; the last watch stopped puts back the hooks that were there before the first start."""
        if not self.active:
            return
        _watches.remove(self)
        if not _watches:
            from triton import knobs

            knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = _before_ours
