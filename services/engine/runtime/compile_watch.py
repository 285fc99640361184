"""Names every Triton compile that happens after start-up: the warm-up and the graph capture are meant to
compile every kernel specialization a request can meet (docs/serving.md "Start-up"), so a compile while
serving is a miss of theirs that one request paid for (a Triton compile is ~0.3-1.5 s of its TTFT).

``CompileWatch.start()`` (the runner calls it once start-up is done, CUDA only) chains Triton's
``knobs.runtime.jit_cache_hook`` (called before a compile: an in-memory cache miss) and
``jit_post_compile_hook`` (after it): each compile is logged once as a warning with the kernel's
specialization (Triton's repr: name, launch options, argument types with their 'D' / constexpr marks) and
its seconds, and kept in ``compiles`` (the GPU test asserts it stays empty under random traffic).
Triton versions without these knobs (< 3.4) are not watched (logged once).
"""

from __future__ import annotations

import time

from services.common.logging import get_logger

log = get_logger("runner")


class CompileWatch:
    def __init__(self) -> None:
        self.compiles: list[dict] = []  # {"kernel": repr, "seconds": s} per compile since start()
        self._t0: dict[str, float] = {}
        self._prev = (None, None)
        self.active = False

    def start(self) -> None:
        """Hook Triton's compile hooks (keeping any hook already installed)."""
        try:
            from triton import knobs
        except ImportError:
            log.info("this Triton has no compile hooks (knobs): compiles after start-up are not reported")
            return
        if self.active:
            return
        rt = knobs.runtime
        self._prev = (rt.jit_cache_hook, rt.jit_post_compile_hook)
        prev_cache, prev_post = self._prev

        def before(**kw):
            self._t0[kw["repr"]] = time.perf_counter()
            return prev_cache(**kw) if prev_cache is not None else None  # a True would skip the compile

        def after(**kw):
            seconds = time.perf_counter() - self._t0.pop(kw["repr"], time.perf_counter())
            self.compiles.append({"kernel": kw["repr"], "seconds": seconds})
            log.warning("Triton compiled %s while serving (%.2f s on a request's path: a specialization the "
                        "start-up warm-up missed)", kw["repr"], seconds)
            return prev_post(**kw) if prev_post is not None else None

        rt.jit_cache_hook, rt.jit_post_compile_hook = before, after
        self.active = True

    def stop(self) -> None:
        """Put back the hooks that were there before ``start``."""
        if self.active:
            from triton import knobs

            knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._prev
            self.active = False
