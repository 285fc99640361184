"""Diagnostic (device call): does a chained decode step really queue ahead of the GPU?

Starts an in-process Engine (synthetic model, CUDA), decodes one request and times, per step, how long
runner.launch and runner.collect hold the model thread, and whether torch reports a synchronizing call
inside launch (torch.cuda.set_sync_debug_mode). Usage: python -m benchmarks.probe_overlap MODEL BACKEND [ARGS]
"""

import ast
import asyncio
import statistics
import sys
import time
import warnings

import torch

from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.runtime.sampler import SamplingParams


def main() -> None:
    model, backend = sys.argv[1], sys.argv[2]
    extra = {k: ast.literal_eval(v) for k, v in (a.split("=", 1) for a in sys.argv[3:])}
    e = Engine(EngineConfig(model=model, device="cuda", dtype="bfloat16", moe_backend=backend, max_running_requests=1,
                            max_seq_len=1024, **extra))
    e.start()
    e.wait_ready(600)
    runner = e.runner
    times = {"launch": [], "collect": []}
    launch, collect = runner.launch, runner.collect

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times[name].append((time.perf_counter() - t0, kwargs.get("sleep"), len(args) > 1 and args[1] is not None))
        return wrapper

    runner.launch, runner.collect = timed("launch", launch), timed("collect", collect)

    async def run(n):
        stream = e.submit(f"probe{n}", list(range(3, 40)), SamplingParams(max_tokens=n, temperature=0.7, top_k=20,
                                                                          top_p=0.8, ignore_eos=True))
        t0 = time.perf_counter()
        async for out in stream:
            pass
        return time.perf_counter() - t0, await e.stats()

    asyncio.run(run(200))  # warm-up (hybrid's tuner settles)
    for k in times:
        times[k].clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        seconds, stats = asyncio.run(run(128))
        torch.cuda.set_sync_debug_mode("default")
    chained = [t for t, _, after in times["launch"] if after]
    plain = [t for t, _, after in times["launch"] if not after]
    print(f"{model} {backend} {extra}: {127 / seconds:.1f} tok/s, chained_steps {stats['chained_steps']}, "
          f"decode step {stats['decode_step_seconds'] / max(1, stats['decode_steps']) * 1e3:.2f} ms")
    for name, xs in (("launch chained", chained), ("launch plain", plain),
                     ("collect sleep", [t for t, s, _ in times["collect"] if s]),
                     ("collect spin", [t for t, s, _ in times["collect"] if not s])):
        if xs:
            print(f"  {name:15s} n={len(xs):4d} median {statistics.median(xs) * 1e3:7.3f} ms  max {max(xs) * 1e3:7.3f} ms")
    seen = {}
    for w in caught:
        key = str(w.message).splitlines()[0][:160]
        seen[key] = seen.get(key, 0) + 1
    for key, n in sorted(seen.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  sync warning x{n}: {key}")
    e.shutdown()


if __name__ == "__main__":
    main()
