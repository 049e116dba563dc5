"""What the host already judged, it does not judge again, and nothing else changes.

* A worker writes an output bit-identical to the last one of its dtype and shape (a precision
  setting its backend ignores) as a hard link to that file, not a copy; a different output,
  or one whose earlier file is gone, is written afresh.
* The host hashes each output file once (a link shares its inode) and forgets the digest
  only with the file's last link (an inode number is reused after that).
* A comparison of the same bits against the same truth is made once per run: a later
  bit-identical output gets the first one's metrics (its own copy); different bits are
  compared afresh. Real matmul cases, real truths and bounds.
"""

from __future__ import annotations

import json
import os

import numpy as np

from diag import numerics
from diag.backends import get_spec
from diag.worker.main import _Written
from diag.compare import elementwise
from diag.run.judge import Judge
from diag.plan.registry import PROBES
from diag.run.store import CaseStore
from diag.plan.suite import load_suite
from diag.worker.protocol import Result


def _cases(tmp_path, shapes):
    path = tmp_path / "s.toml"
    path.write_text('[suite]\nname = "s"\nseed = 5\n\n[[probe]]\nname = "mm"\nop = "matmul"\n'
                    f'inputs = "normal"\ndtypes = ["float32"]\nshapes = {json.dumps(shapes)}\n')
    return load_suite(str(path)).cases


def _event(path, array) -> Result:
    """A result event as a worker sends it, for one float output written to `path`."""
    return Result(case="c0000", timings={}, input_digests=[], outputs=[
        {"name": "output", "path": str(path), "shape": list(array.shape),
         "dtype": numerics.dtype_name(array.dtype)}])


def test_an_identical_output_is_a_link_and_a_different_one_a_file(tmp_path):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((300, 200)).astype(np.float32)
    b = a.copy()
    b[-1, -1] = np.nextafter(b[-1, -1], np.inf)  # differs in its last element only
    written = _Written()
    paths = [tmp_path / f"{i}.npy" for i in range(6)]
    written.save(0, str(paths[0]), numerics.bits_view(a))
    written.save(0, str(paths[1]), numerics.bits_view(a.copy()))  # same bits, another array
    written.save(0, str(paths[2]), numerics.bits_view(b))
    written.save(0, str(paths[3]), numerics.bits_view(b.reshape(200, 300)))  # another shape
    written.save(1, str(paths[4]), numerics.bits_view(b.reshape(200, 300)))  # another slot
    inode = [os.stat(p).st_ino for p in paths[:5]]
    assert inode[1] == inode[0] and os.stat(paths[0]).st_nlink == 2
    assert len({inode[0], inode[2], inode[3], inode[4]}) == 4
    for p, want in zip(paths[:5], [a, a, b, b.reshape(200, 300), b.reshape(200, 300)]):
        got = numerics.from_bits(np.load(p), "float32")
        assert np.array_equal(numerics.bits_view(got), numerics.bits_view(want))
    os.unlink(paths[3])  # the host is done with it: the next identical output is a file
    written.save(0, str(paths[5]), numerics.bits_view(b.reshape(200, 300)))
    assert os.stat(paths[5]).st_nlink == 1


def test_a_file_is_hashed_once_and_forgotten_with_its_last_link(tmp_path, monkeypatch):
    hashed = []
    real = numerics.bits_digest
    monkeypatch.setattr(numerics, "bits_digest", lambda x: hashed.append(1) or real(x))
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.save(tmp_path / "a.npy", numerics.bits_view(x))
    os.link(tmp_path / "a.npy", tmp_path / "b.npy")
    judge = CaseStore(tmp_path, str(tmp_path / "cache"))
    first = judge.output_digest(str(tmp_path / "a.npy"), x)
    assert judge.output_digest(str(tmp_path / "b.npy"), x) == first == real(x)
    assert len(hashed) == 1
    judge.release(str(tmp_path / "a.npy"))  # a link remains: its digest is still known
    assert judge.output_digest(str(tmp_path / "b.npy"), x) == first and len(hashed) == 1
    judge.release(str(tmp_path / "b.npy"))
    assert not list(tmp_path.glob("*.npy")) and judge._file_digests == {}
    judge.release(str(tmp_path / "b.npy"))  # already gone: nothing to do


def test_the_same_bits_against_the_same_truth_are_compared_once(tmp_path, monkeypatch):
    calls = {"compare": 0, "agreement": 0}
    for name in calls:
        real = getattr(elementwise, name)

        def counted(*args, real=real, name=name):
            calls[name] += 1
            return real(*args)

        monkeypatch.setattr(f"diag.probes.matmul.{name}", counted)
    (case,) = _cases(tmp_path, [[64, 32, 48]])
    judge = Judge(tmp_path, str(tmp_path / "cache"))
    spec = get_spec("jax-cpu")
    a, b = (np.asarray(x) for x in judge.store.inputs.get(case))
    product = np.matmul(a, b)
    rounded = product.astype(np.float16).astype(np.float32)  # less precise: a warn or fail
    outputs = {"p1": product, "p2": product.copy(), "r": rounded}
    outcomes = {}
    for name, out in outputs.items():
        np.save(tmp_path / f"{name}.npy", numerics.bits_view(out))
        outcomes[name] = judge.outcome(case, spec, _event(tmp_path / f"{name}.npy", out))
    verdicts = {n: PROBES["matmul"].evaluate(o) for n, o in outcomes.items()}
    assert calls["compare"] == 2 and judge.store.recalled == 1  # p2 is p1's bits
    assert verdicts["p1"].metrics == verdicts["p2"].metrics != verdicts["r"].metrics
    assert verdicts["p1"].metrics is not verdicts["p2"].metrics  # each record its own copy
    truth = judge.store.truth.get(case).value
    fresh = elementwise.compare(product, truth, verdicts["r"].context())
    assert json.dumps(verdicts["p2"].metrics) == json.dumps(fresh)
    agree = PROBES["matmul"].agree
    first = agree(outcomes["p1"], outcomes["r"], ("a", "b"), verdicts["r"].context)
    again = agree(outcomes["p2"], outcomes["r"], ("a", "b"), verdicts["r"].context)
    assert calls["agreement"] == 1 and first == again and first.metrics["mismatched"] > 0
