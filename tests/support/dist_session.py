"""Every two-process training claim of the suite in one ``jzero launch`` run of 2 processes x 4
devices: starting two JAX processes (imports, the distributed runtime) costs more than any one
of these claims, so they share one run.

The child (``python dist_session.py DIR``, under ``jzero launch``) runs these tasks in order, each
process passing only its rows of every global batch, and process 0 prints one JSON record per
task, ``{"task": name, ...}``:

* ``flat2``, ``flat3``: the toy at stages 2 and 3 on ``{data: 8}`` (:mod:`dist_train`);
* ``hybrid_stage1``, ``hybrid_hpz``: a replica per process (:mod:`dist_hybrid`);
* ``moe``: the MoE toy with starved experts (:mod:`dist_moe`);
* ``pipe_tp``: the GPT on ``{pipe: 2, data: 2, model: 2}``, a stage per process
  (:mod:`dist_pipe_tp`);
* ``ckpt_save``: trains and saves into ``DIR/ckpt_two``; ``ckpt_resume``: restores what this
  process saved into ``DIR/ckpt_one`` and trains on (:mod:`dist_ckpt`);
* ``nvme``: the optimizer state and the parameters on NVMe under ``DIR/nvme``
  (:mod:`dist_nvme`);
* ``weights_export``: exports into ``DIR/weights_two``; ``weights_import``: starts from the
  export this process wrote into ``DIR/weights_one`` (:mod:`dist_weights`).

The tests (all in tests/distributed/test_two_processes.py, so that one xdist worker launches
it once per run) call :func:`run`: once per pytest process, it writes ``DIR/ckpt_one`` and
``DIR/weights_one`` here, launches the two processes (bounded by a timeout, every process
killed at the end however it ends) and returns the records by task, process 1's output lines
and DIR.
"""

import atexit
import functools
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import jax

sys.path.insert(0, os.path.dirname(__file__))
import collector  # noqa: E402
import dist_ckpt  # noqa: E402
import dist_hybrid  # noqa: E402
import dist_moe  # noqa: E402
import dist_nvme  # noqa: E402
import dist_pipe_tp  # noqa: E402
import dist_train  # noqa: E402
import dist_weights  # noqa: E402

TIMEOUT = 400  # seconds for the whole launch


def tasks(directory: Path) -> dict:
    """The tasks in the order the child runs them: name -> a function returning the record."""
    out = {f"flat{s}": functools.partial(dist_train.train, s) for s in dist_train.STAGES}
    out |= {f"hybrid_{n}": functools.partial(dist_hybrid.train, n) for n in dist_hybrid.RUNS}
    out["moe"] = dist_moe.train
    out["pipe_tp"] = dist_pipe_tp.train
    out["ckpt_save"] = functools.partial(dist_ckpt.run, "save", str(directory / "ckpt_two"))
    out["ckpt_resume"] = functools.partial(dist_ckpt.run, "resume", str(directory / "ckpt_one"))
    out["nvme"] = functools.partial(dist_nvme.run, str(directory / "nvme"))
    out["weights_export"] = functools.partial(
        dist_weights.run, "export", str(directory / "weights_two")
    )
    out["weights_import"] = functools.partial(
        dist_weights.run, "import", str(directory / "weights_one")
    )
    return out


def main() -> None:
    from jzero import distributed

    jax.config.update("jax_enable_x64", True)
    distributed.init_distributed()  # the runtime first, as a user script does
    collector.space_out()  # a test harness's process, as the pytest workers (collector.py)
    collector.freeze_imports()
    for name, task in tasks(Path(sys.argv[1])).items():
        record = task()
        if distributed.is_main_process():
            print(json.dumps({"task": name, **record}), flush=True)


@functools.cache
def run() -> dict:
    """{"records": {task: record}, "p1_lines": process 1's output lines, "dir": DIR}."""
    from procs import Children, child_env, launcher

    directory = Path(tempfile.mkdtemp(prefix="jzero-two-processes-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    with jax.enable_x64(True), dist_ckpt.make_engine(str(directory / "ckpt_one")) as engine:
        dist_ckpt.train(engine, dist_ckpt.batches()[: dist_ckpt.SAVED_AT])
        engine.save()
    with jax.enable_x64(False):
        dist_weights.export_here(directory / "weights_one")
    c = Children()
    try:
        cmd = launcher("-n", "2", "--devices-per-process", "4", "--", sys.executable)
        p = c.start([*cmd, __file__, str(directory)], child_env())
        assert c.finish(p, timeout=TIMEOUT) == 0, "".join(p.out + p.err)
        lines = p.out
    finally:
        c.kill_all()
    records = [json.loads(line.split(" ", 1)[1]) for line in lines if line.startswith("[p0] {")]
    assert [r["task"] for r in records] == list(tasks(directory)), lines
    return {
        "records": {r.pop("task"): r for r in records},
        "p1_lines": [line for line in lines if line.startswith("[p1] ")],
        "dir": directory,
    }


if __name__ == "__main__":
    main()
