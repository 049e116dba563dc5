"""The accuracy worker: runs one backend's elementwise calls in a process of its own.

    python -m diag.accuracy.worker JOB.json

Why a process: as for diag's other workers (`diag.worker.main`), JAX and torch_xla must not
share one, torch_xla needs its own Python (`--python torch-xla=PATH`), and a framework that
crashes must not take the table down. This module imports numpy and, inside `_runner`, the
one framework the job names; nothing of diag's beyond that, so it runs under any Python that
has numpy and the framework.

Job (JSON): {"backend", "framework" (jax | torch | torch_xla), "platform", "repeats",
"items": [{"id", "call": dotted path, "kwargs", "accuracy": null | [kind, arguments],
"dtype", "input": .npy of the inputs' raw bits, "output": .npy to write the outputs' bits}]}.
JAX runs each call under `jax.jit`; PyTorch eagerly; torch_xla on its lazy device, synced.
Each item is answered by one JSON line on stdout: {"id", "compile_s", "seconds"} (the first
call, then the median of `repeats` warm calls, each waiting for the device) or {"id",
"error"}; the last line is {"done": true, "versions": {...}}. Anything the framework prints
goes to stderr.
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

_BITS = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.uint32}


def resolve(path: str) -> Any:
    """The object a dotted path names: its longest importable module, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(f"cannot import {path}")


def _jax(platform: str):
    import jax
    import ml_dtypes

    device = jax.devices(platform)[0]
    dtypes = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}

    def prepare(item: dict, fn: Callable) -> tuple[Callable, Any]:
        bits = np.load(item["input"])
        x = jax.device_put(bits.view(dtypes[item["dtype"]]), device)
        compiled = jax.jit(fn)
        return (lambda: compiled(x).block_until_ready()), None

    def to_bits(y: Any, dtype: str) -> np.ndarray:
        return np.asarray(y).view(_BITS[dtype])

    def accuracy(kind: str, args: dict) -> Any:
        if kind == "AccuracyMode":
            return jax.lax.AccuracyMode[args["name"]]
        return jax.lax.Tolerance(**args)

    return prepare, to_bits, accuracy, {"jax": jax.__version__}


def _torch(platform: str, lazy: bool):
    import torch

    versions = {"torch": torch.__version__}
    if lazy:
        os.environ["PJRT_DEVICE"] = platform.upper()
        import torch_xla
        import torch_xla.core.xla_model as xm

        device = torch_xla.device()
        versions["torch_xla"] = torch_xla.__version__

        def wait() -> None:
            torch_xla.sync()
            xm.wait_device_ops()
    else:
        device = torch.device(platform)

        def wait() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize()

    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    signed = {np.uint16: np.int16, np.uint32: np.int32}

    def prepare(item: dict, fn: Callable) -> tuple[Callable, Any]:
        bits = np.load(item["input"])
        host = torch.from_numpy(bits.view(signed[bits.dtype.type])).view(dtypes[item["dtype"]])
        x = host.to(device)
        wait()
        held: list = []

        def call() -> None:
            held[:] = [fn(x)]
            wait()

        return call, held

    def to_bits(y: Any, dtype: str) -> np.ndarray:
        signed_dtype = torch.int16 if dtype != "float32" else torch.int32
        return y.cpu().view(signed_dtype).numpy().view(_BITS[dtype])

    return prepare, to_bits, None, versions


def _runner(framework: str, platform: str):
    if framework == "jax":
        return _jax(platform)
    return _torch(platform, lazy=framework == "torch_xla")


def _item(item: dict, prepare, to_bits, accuracy, repeats: int) -> dict:
    op = resolve(item["call"])
    kwargs = dict(item.get("kwargs") or {})
    if item.get("accuracy"):
        kwargs["accuracy"] = accuracy(*item["accuracy"])

    def fn(x):
        return op(x, **kwargs)

    call, held = prepare(item, fn)
    start = time.perf_counter()
    out = call()
    compile_s = time.perf_counter() - start
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = call()
        samples.append(time.perf_counter() - start)
    y = held[0] if held is not None else out
    np.save(item["output"], to_bits(y, item["dtype"]), allow_pickle=False)
    return {"id": item["id"], "compile_s": compile_s, "seconds": statistics.median(samples)}


def main(argv: list[str]) -> int:
    job = json.loads(open(argv[0]).read())
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the framework's prints and native logs go to stderr, not the answers
    sys.stdout = sys.stderr
    prepare, to_bits, accuracy, versions = _runner(job["framework"], job["platform"])
    for item in job["items"]:
        try:
            answer = _item(item, prepare, to_bits, accuracy, int(job.get("repeats", 3)))
        except Exception as e:  # noqa: BLE001 - one call's failure is its row's, not the job's
            answer = {"id": item["id"], "error": f"{type(e).__name__}: {e}"}
        proto.write(json.dumps(answer) + "\n")
    proto.write(json.dumps({"done": True, "versions": versions}) + "\n")
    proto.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
