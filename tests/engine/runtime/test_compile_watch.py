"""CompileWatch chains Triton's compile hooks: each compile after start is kept with its kernel and seconds
(and logged), hooks installed before it still run (a True from the cache hook still skips the compile),
and ``stop`` puts them back. The hooks are called here as Triton calls them (keywords); on a GPU
tests/kernels/test_warm_covers_requests.py counts real compiles through them."""

from __future__ import annotations

from triton import knobs

from services.engine.runtime.compile_watch import CompileWatch


def _call(hook, name: str):
    return hook(key=name, repr=name, fn=None, compile={}, is_manual_warmup=False, already_compiled=False)


def test_compiles_are_kept_and_earlier_hooks_still_run(monkeypatch):
    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: seen.append(("cache", kw["repr"])) or True)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append(("post", kw["repr"])))
    before = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    watch = CompileWatch()
    watch.start()
    assert watch.active
    assert _call(knobs.runtime.jit_cache_hook, "_k[num_warps=4](R: i32)") is True  # the earlier hook's answer
    _call(knobs.runtime.jit_post_compile_hook, "_k[num_warps=4](R: i32)")
    assert [c["kernel"] for c in watch.compiles] == ["_k[num_warps=4](R: i32)"]
    assert watch.compiles[0]["seconds"] >= 0
    assert seen == [("cache", "_k[num_warps=4](R: i32)"), ("post", "_k[num_warps=4](R: i32)")]
    watch.stop()
    assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == before and not watch.active


def test_without_earlier_hooks_the_compile_goes_ahead(monkeypatch):
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    watch = CompileWatch()
    watch.start()
    try:
        assert _call(knobs.runtime.jit_cache_hook, "k") is None  # None: Triton compiles
        _call(knobs.runtime.jit_post_compile_hook, "k")
        assert len(watch.compiles) == 1
    finally:
        watch.stop()
    assert knobs.runtime.jit_cache_hook is None and knobs.runtime.jit_post_compile_hook is None
