"""CompileWatch chains Triton's compile hooks: each compile after start is kept with its kernel and seconds
(and logged), hooks installed before it still run (a True from the cache hook still skips the compile),
and ``stop`` puts them back; two watches log a compile once; the log line is built from the signature, not
from Triton's cut ``repr``. The hooks are called here as Triton calls them (keywords); on a GPU
tests/kernels/test_warm_covers_requests.py counts real compiles through them."""

from __future__ import annotations

import logging

import triton.language as tl
from triton import knobs

from services.engine.runtime.compile_watch import CompileWatch, describe_compile


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


def _scale_kernel(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):  # only its signature is used
    pass


def _hook_kwargs_of_a_compile() -> dict:
    """The keywords Triton's own JITFunction._call_hook passes for a compile of _scale_kernel with two
    16-divisible pointers and BLOCK=64 (what the GPU passes; the interpreter never calls the hooks)."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.runtime.jit import JITFunction

    seen = {}
    key = str([("*bf16", "D"), ("*fp32", "D"), ("i32", ""), ("fp32", ""), ("constexpr", 64)]) + "options"
    signature = {"x_ptr": "*bf16", "out_ptr": "*fp32", "n": "i32", "scale": "fp32", "BLOCK": "constexpr"}
    JITFunction(_scale_kernel)._call_hook(lambda **kw: seen.update(kw), key, signature, GPUTarget("cuda", 90, 32), 0,
                                          {(4,): 64}, CUDAOptions(num_warps=4),
                                          [{(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}], False)
    return seen


def test_a_compile_is_described_from_its_signature_not_tritons_cut_repr():
    kw = _hook_kwargs_of_a_compile()
    assert kw["repr"].endswith("(x_ptr: ()")  # Triton's repr: the first parameter, "(" for its type
    assert describe_compile(kw) == ("test_compile_watch._scale_kernel[num_warps=4, num_stages=3, num_ctas=1]"
                                    "(x_ptr: *bf16 %16, out_ptr: *fp32 %16, n: i32, scale: fp32, BLOCK=64)")
    assert describe_compile({"repr": "k[]()"}) == "k[]()"  # nothing else passed: Triton's repr
    partial = {"fn": None, "compile": {"signature": {"a": "i64", "B": "constexpr"}}}  # no constants, configs, options
    assert describe_compile(partial) == "?[](a: i64, B=?)"


def test_two_watches_log_each_compile_once_and_both_keep_it(monkeypatch, caplog):
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    first, second = CompileWatch(), CompileWatch()  # e.g. a runner per bench config, the first never closed
    first.start()
    second.start()
    try:
        kw = _hook_kwargs_of_a_compile()
        with caplog.at_level(logging.WARNING):
            assert knobs.runtime.jit_cache_hook(**kw) is None
            knobs.runtime.jit_post_compile_hook(**kw)
        lines = [r.getMessage() for r in caplog.records if "Triton compiled" in r.getMessage()]
        assert len(lines) == 1 and "_scale_kernel[" in lines[0] and "BLOCK=64" in lines[0]
        assert len(first.compiles) == len(second.compiles) == 1
        first.stop()
        assert knobs.runtime.jit_post_compile_hook is not None  # the second still watches
    finally:
        first.stop()
        second.stop()
    assert knobs.runtime.jit_cache_hook is None and knobs.runtime.jit_post_compile_hook is None
