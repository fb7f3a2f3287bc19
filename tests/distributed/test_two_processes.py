"""Every claim the suite checks on 2 processes x 4 devices, from one ``jzero launch`` run.

Starting two JAX processes (imports, the distributed runtime) costs more than any one claim, so
the tasks share one launch (``dist_session.run``, bounded by its timeout; every process is killed
at the end however it ends). The launch happens once per pytest process, and these tests live in
one file so that one xdist worker holds them all and the run launches it once.

Each task's reference is computed here, on one process with 8 devices; the tasks that train in
float64 match it at 1e-10 (``procs.LOSS_RTOL``).
"""

import json
import os

import dist_ckpt
import dist_hybrid
import dist_moe
import dist_nvme
import dist_session
import dist_train
import jax
import numpy as np
import optax
import pytest
import toy
from moe_toy import batches, bias_first_device_only, make_params, reference, reference_run
from numerics import EPS, rounding_scale
from procs import LOSS_RTOL

import jzero
from jzero.weights import leaf_entries, load_exported


@pytest.fixture(scope="module")
def session():
    assert jax.device_count() == 8 and jax.process_count() == 1
    return dist_session.run()


def assert_close(got, want, rtol=LOSS_RTOL):
    got, want = np.asarray(got), np.asarray(want)
    err = float(np.max(np.abs(got - want))) / max(float(np.max(np.abs(want))), 1e-300)
    assert err <= rtol, f"relative error {err:.3g} > {rtol}"


# -- the toy on {data: 8} at stages 2 and 3 -------------------------------------------------------
@pytest.fixture(scope="module")
def flat_runs(session):
    """(the two-process records per stage, the one-process records per stage)."""
    records = [session["records"][f"flat{stage}"] for stage in dist_train.STAGES]
    return records, {stage: dist_train.reference(stage) for stage in dist_train.STAGES}


def test_two_processes_train_like_one_process_on_eight_devices(session, flat_runs):
    records, one_process_run = flat_runs
    first = dist_train.first_grad_norm()
    assert not [line for line in session["p1_lines"] if line.startswith("[p1] {")]  # p0 reports
    assert [r["stage"] for r in records] == list(dist_train.STAGES)
    for r in records:
        ref = one_process_run[r["stage"]]
        assert (r["process_count"], r["device_count"], r["local_rows"]) == (2, 8, 8)
        assert (ref["process_count"], ref["device_count"], ref["local_rows"]) == (1, 8, 16)
        assert r["dtype"] == ref["dtype"] == "float64"
        np.testing.assert_allclose(r["losses"], ref["losses"], rtol=LOSS_RTOL, atol=0)
        np.testing.assert_allclose(r["norms"], ref["norms"], rtol=LOSS_RTOL, atol=0)
        # Clipping (0.5) hides a gradient's scale from the losses: the first grad norm is the
        # optax gradient's.
        assert ref["norms"][0] == pytest.approx(first, rel=LOSS_RTOL, abs=0)
        assert len(set(ref["losses"])) == len(ref["losses"])  # it trains


def test_a_whole_global_batch_on_two_processes_names_both_sizes(flat_runs):
    records, one_process_run = flat_runs
    for r in records:
        assert "has leading dim 16" in r["error"]
        assert "each of the 2 processes passes its 8 rows" in r["error"]
        assert "global train_batch_size 16" in r["error"]
        one = one_process_run[r["stage"]]["error"]  # one process: the global batch is expected
        assert "has leading dim 1 but train_batch_size is 16" in one


# -- checkpoints between 2 processes and 1 --------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt_reference():
    """dist_ckpt's engine without the checkpoint, uninterrupted here: (losses, grad norms)."""
    ref = dist_train.reference(dist_ckpt.STAGE)
    return ref["losses"], ref["norms"]


def assert_steps(losses, norms, reference, steps):
    assert reference[1][0] == pytest.approx(dist_train.first_grad_norm(), rel=LOSS_RTOL, abs=0)
    np.testing.assert_allclose(losses, reference[0][steps], rtol=LOSS_RTOL, atol=0)
    np.testing.assert_allclose(norms, reference[1][steps], rtol=LOSS_RTOL, atol=0)


def test_saved_by_two_processes_restored_in_one(session, ckpt_reference):
    saved = session["records"]["ckpt_save"]
    assert saved["processes"] == 2
    assert_steps(saved["losses"], saved["norms"], ckpt_reference, slice(None, dist_ckpt.SAVED_AT))
    with jax.enable_x64(True), dist_ckpt.make_engine(str(session["dir"] / "ckpt_two")) as engine:
        engine.restore()
        assert engine.global_step == dist_ckpt.SAVED_AT
        losses, norms = dist_ckpt.train(engine, dist_ckpt.batches()[dist_ckpt.SAVED_AT :])
    assert_steps(losses, norms, ckpt_reference, slice(dist_ckpt.SAVED_AT, None))


def test_saved_by_one_process_restored_in_two(session, ckpt_reference):
    # dist_session.run saved ckpt_one here (SAVED_AT steps of dist_ckpt.make_engine) before
    # the launch; the two processes restored it and trained on.
    resumed = session["records"]["ckpt_resume"]
    assert resumed["processes"] == 2
    assert_steps(
        resumed["losses"], resumed["norms"], ckpt_reference, slice(dist_ckpt.SAVED_AT, None)
    )


# -- a replica per process (hybrid sharding) ------------------------------------------------------
def test_two_processes_one_replica_each(session):
    record_lines = [session["records"][f"hybrid_{name}"] for name in dist_hybrid.RUNS]
    for r in record_lines:
        ref = dist_hybrid.train(r["run"])
        assert r["process_count"] == 2 and r["mesh"] == {"replica": 2, "data": 4}
        assert r["processes"] == [[0, 0, 0, 0], [1, 1, 1, 1]]  # a replica per process
        assert r["dtype"] == ref["dtype"] == "float64"
        np.testing.assert_allclose(r["losses"], ref["losses"], rtol=1e-10, atol=0)
        np.testing.assert_allclose(r["norms"], ref["norms"], rtol=1e-10, atol=0)
        # A sum of magnitudes, as close as the parameters (1e-9 of their scale).
        assert r["checksum"] == pytest.approx(ref["checksum"], rel=1e-9, abs=0)
        # Clipping (0.5) and Adam hide a gradient's scale from the losses: the first grad norm
        # is the optax gradient's.
        assert ref["norms"][0] == pytest.approx(dist_hybrid.first_grad_norm(), rel=1e-10, abs=0)
    assert [r["run"] for r in record_lines] == list(dist_hybrid.RUNS)


# -- experts: the expert axis within a process, data across them ----------------------------------
def test_two_processes_with_starved_experts_train_and_match_the_reference(session):
    """The expert axis is minor, so each expert group of 4 is one process's devices and
    ``data`` (ZeRO over the expert leaves, the dense leaves' reduction) crosses the
    processes."""
    record = session["records"]["moe"]
    assert record["process_count"] == 2 and record["mesh"] == {"data": 2, "expert": 4}
    assert record["processes"] == [[0, 0, 0, 0], [1, 1, 1, 1]]
    with jax.enable_x64(True):
        params = make_params(bias=bias_first_device_only())
        steps = batches(dist_moe.STEPS, seed=dist_moe.SEED)
        want, _ = reference_run(params, reference(1.0, 2), steps)
    # float64: the slots and the dense reference add the same products in other orders.
    for got, drop, (value, aux) in zip(record["losses"], record["dropped"], want, strict=True):
        assert_close(got, value)
        assert drop == aux["moe_dropped_fraction"] > 0


# -- weights exported and imported ----------------------------------------------------------------
def flat(tree):
    return {
        e.key: np.asarray(x) for e, x in zip(leaf_entries(tree), jax.tree.leaves(tree), strict=True)
    }


def test_two_processes_export_each_its_own_files_and_import_their_own_shards(session):
    """Stage 3: each process writes the files it owns (process 0 the index), and the export
    equals the parameters; an export written here (dist_weights.export_here, before the launch)
    loads on two processes straight into their shards, bit-identically."""
    out = session["dir"] / "weights_two"
    assert session["records"]["weights_export"] == {"processes": 2}
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2 and all((out / f).is_file() for f in files)
    want = flat(toy.make_params(seed=7))
    got = flat(load_exported(out))
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    imported = session["records"]["weights_import"]
    assert imported == {"processes": 2, "equal": True, "laid_out": True}


# -- the optimizer state and the parameters on NVMe -----------------------------------------------
def test_two_processes_each_keep_their_shards_in_files(session):
    """Stage 3 bf16, optimizer state and parameters on NVMe under one nvme_path: each process
    has its own store, and the losses are those of one process with everything in memory."""
    record = session["records"]["nvme"]
    batches = toy.make_batches(dist_nvme.STEPS, dist_nvme.GLOBAL_BATCH)
    e = jzero.initialize(toy.make_params(), toy.loss_fn, optax.adamw(1e-2), dist_nvme.config(None))
    metrics = [e.train_step(b) for b in batches]
    want = [float(m["loss"]) for m in metrics]
    e.close()
    # The child trains in bf16, its gradients reduced across the processes in another order
    # than in one process: each run is as far from the same training in float64 as bf16
    # rounding takes it (rounding_scale), the two at most twice that from each other.
    with jax.enable_x64(True):
        cfg = dict(dist_nvme.config(None), bf16={"enabled": False})
        params = toy.make_params(dtype=np.float64)
        e = jzero.initialize(params, toy.loss_fn, optax.adamw(1e-2), cfg)
        truth = [float(e.train_step(jax.tree.map(np.float64, b))["loss"]) for b in batches]
        e.close()
        # The one-process run's first gradient against optax's (clipping and Adam hide a
        # gradient's scale from the losses): within 16 bf16 unit roundoffs (test_parity.py).
        grads = jax.grad(toy.loss_fn)(params, jax.tree.map(np.float64, batches[0]))
        first = float(optax.global_norm(grads))
    assert float(metrics[0]["grad_norm"]) == pytest.approx(first, rel=16 * EPS["bfloat16"])
    np.testing.assert_allclose(record["losses"], want, rtol=0, atol=2 * rounding_scale(want, truth))
    counts = list(record["files"].values())
    assert len(counts) == 2 and counts[0] == counts[1] > 0, record["files"]
    assert not os.listdir(session["dir"] / "nvme")  # both stores removed at close


# -- 3-D parallelism, the pipe axis across the processes -------------------------------------------
def test_two_processes_one_pipeline_stage_each_split_over_model_within(session):
    """{pipe: 2, data: 2, model: 2} at stage 3: each process holds one stage, its layers split
    over its own model devices; both pass every row (the stages read the same rows)."""
    import compositions
    import dist_pipe_tp

    record = session["records"]["pipe_tp"]
    assert record["mesh"] == {"pipe": 2, "data": 2, "model": 2}
    assert record["processes"] == [[0], [1]]  # stage s on process s only
    with jax.enable_x64(True):
        want, _ = compositions.reference(
            compositions.model_config(dist_pipe_tp.AXES), compositions.BATCH
        )
    for (loss, norm), (ref_loss, ref_norm) in zip(record["metrics"], want, strict=True):
        assert loss == pytest.approx(ref_loss, rel=LOSS_RTOL)
        assert norm == pytest.approx(ref_norm, rel=LOSS_RTOL)
