"""Weights out as Hugging Face's sharded safetensors (engine.save_16bit_model, the checkpoint
export CLI, stage3_gather_16bit_weights_on_model_save on save) and weights in with
jzero.InitOptions(init_from=...): straight into the plan's shards, at another stage and device
count, with one error listing every mismatch, in bounded host memory."""

import argparse
import json
import os
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import optax
import pytest
import toy
from procs import device_env
from repo import ROOT, SUPPORT

import jzero
from jzero.checkpoint import Checkpointer
from jzero.cli.checkpoint import add_commands
from jzero.step import logical_view
from jzero.weights import (
    INDEX_NAME,
    leaf_entries,
    load_exported,
    load_weights,
    read_index,
    write_leaves,
)

BF16 = {"bf16": {"enabled": True}}
STAGE3 = {"stage": 3, "stage3_param_persistence_threshold": 0}


def make_engine(stage=3, extra=None, params=None, init_from=None, name_map=None):
    cfg = {"train_batch_size": 32, "zero_optimization": {**STAGE3, "stage": stage}, **(extra or {})}
    params = toy.make_params() if params is None else params
    options = jzero.InitOptions(init_from=init_from, name_map=name_map)
    return jzero.initialize(params, toy.loss_fn, optax.sgd(0.1), cfg, options=options)


def child_env(num_devices):
    env = device_env(num_devices)  # the run's XLA flags and compile cache
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(SUPPORT), env.get("PYTHONPATH", "")])
    env["JAX_PLATFORMS"] = "cpu"
    return env


def run_child(script, *args, devices=8, timeout=300, env=None):
    proc = subprocess.run(
        [sys.executable, str(SUPPORT / script), *map(str, args)],
        env={**child_env(devices), **(env or {})},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,  # subprocess.run kills the child when it runs over
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def flat(tree):
    return {
        e.key: np.asarray(x) for e, x in zip(leaf_entries(tree), jax.tree.leaves(tree), strict=True)
    }


def bf16_params():
    return {k: v.astype(ml_dtypes.bfloat16) for k, v in flat(toy.make_params()).items()}


def test_save_16bit_model_writes_sharded_bf16(tmp_path):
    engine = make_engine(extra=BF16)
    index = engine.save_16bit_model(tmp_path / "hf", max_shard_size="20KB")
    assert index == tmp_path / "hf" / INDEX_NAME
    root, weight_map, meta = read_index(index)
    want = bf16_params()
    assert sorted(weight_map) == sorted(want)  # every tensor has a file
    files = sorted(set(weight_map.values()))
    assert len(files) >= 3 and all(f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    assert {p.name for p in root.iterdir()} == {*files, INDEX_NAME}
    assert meta["total_size"] == sum(x.nbytes for x in want.values())
    got = flat(load_exported(root))
    for k, x in want.items():
        assert got[k].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(got[k], x)
    # Loaded back under bf16: the master weights are the bf16 values, exactly.
    again = make_engine(extra=BF16, init_from=root)
    for k, x in flat(logical_view(again.plan, again.state).master).items():
        np.testing.assert_array_equal(x, want[k].astype(np.float32))
    for k, x in flat(again.params).items():
        np.testing.assert_array_equal(x, want[k])


def test_save_16bit_model_with_a_name_map_round_trips(tmp_path):
    # Hugging Face's names in the files (its "model.layers.N...weight" style), jzero's tree
    # back from them: through load_exported (the nesting kept in the metadata) and through
    # init_from with the same map.
    def hf(path):
        return "model." + path.replace("blocks.", "layers.").replace(".w", ".weight")

    engine = make_engine(extra=BF16)
    index = engine.save_16bit_model(tmp_path / "hf", max_shard_size="20KB", names=hf)
    root, weight_map, _ = read_index(index)
    want = bf16_params()
    assert sorted(weight_map) == sorted(hf(k) for k in want)
    assert "model.layers.weight" in weight_map and "blocks.w" not in weight_map
    got = flat(load_exported(root))  # jzero's own tree, whatever the files call it
    assert sorted(got) == sorted(want)
    for k, x in want.items():
        np.testing.assert_array_equal(got[k], x)
    again = make_engine(extra=BF16, init_from=root, name_map=hf)
    for k, x in flat(again.params).items():
        np.testing.assert_array_equal(x, want[k])
    with pytest.raises(ValueError, match=r"names gave the leaf 'embed' the name ''; it must"):
        engine.save_16bit_model(tmp_path / "bad", names={"embed": ""})
    with pytest.raises(ValueError, match="Two leaves export under the same key 'same'"):
        engine.save_16bit_model(tmp_path / "bad", names=lambda path: "same")


def test_gather_16bit_on_save_writes_beside_the_checkpoints(tmp_path):
    ckpt = tmp_path / "ckpt"
    extra = {
        **BF16,
        "checkpoint": {"directory": str(ckpt), "async": False, "max_to_keep": 1},
    }
    cfg_zero = {**STAGE3, "stage3_gather_16bit_weights_on_model_save": True}
    cfg = {"train_batch_size": 32, "zero_optimization": cfg_zero, **extra}
    with jzero.initialize(toy.make_params(), toy.loss_fn, optax.sgd(0.1), cfg) as engine:
        assert engine.save(step=1)
        out = tmp_path / "ckpt_16bit"
        got = flat(load_exported(out / "1"))
        want = bf16_params()
        assert sorted(got) == sorted(want)
        for k, x in want.items():
            np.testing.assert_array_equal(got[k], x)
        assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == ["1"]
        assert engine.save(step=2)  # max_to_keep 1: step 1 rotates out, and its 16-bit copy
        assert sorted(p.name for p in out.iterdir()) == ["2", "jzero_16bit.json"]
    # A folder of the user's where the 16-bit models would go is refused, untouched.
    other = tmp_path / "other"
    (tmp_path / "other_16bit").mkdir()
    (tmp_path / "other_16bit" / "notes.txt").write_text("mine")
    cfg["checkpoint"] = {"directory": str(other), "async": False}
    with jzero.initialize(toy.make_params(), toy.loss_fn, optax.sgd(0.1), cfg) as engine:
        with pytest.raises(ValueError, match="not jzero's"):
            engine.save(step=1)
    assert [p.name for p in (tmp_path / "other_16bit").iterdir()] == ["notes.txt"]
    assert not other.exists() or not any(p.name.isdigit() for p in other.iterdir())


def test_init_from_single_file_and_checkpoint_into_the_plans_shards(tmp_path):
    params = toy.make_params(seed=3)
    entries = leaf_entries(params)
    leaves = jax.tree.leaves(params)
    write_leaves(tmp_path / "p.safetensors", entries, lambda i: np.asarray(leaves[i]))
    with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        ckpt.save(1, {"params": params})
    want = flat(params)
    for source in (tmp_path / "p.safetensors", tmp_path / "ckpt"):
        engine = make_engine(init_from=source)  # stage 3: params sharded at rest
        for k, x in flat(engine.params).items():
            np.testing.assert_array_equal(x, want[k])
        # Read straight into the plan's shards (the resting arrays, padded where they must be).
        resting = jax.tree.leaves(engine.state.params)
        for x, s, a in zip(
            resting,
            jax.tree.leaves(engine.plan.params),
            jax.tree.leaves(engine.plan.stored_params),
            strict=True,
        ):
            assert x.sharding.is_equivalent_to(s, x.ndim) and x.shape == a.shape
        assert not any(x.sharding.is_fully_replicated for x in resting)
    # The config's checkpoint.init_from does the same (e.g. for jzero train).
    engine = make_engine(extra={"checkpoint": {"init_from": str(tmp_path / "p.safetensors")}})
    for k, x in flat(engine.params).items():
        np.testing.assert_array_equal(x, want[k])


def test_cli_export_bf16_sharded_and_load_it(tmp_path, capsys):
    params = toy.make_params(seed=5)
    with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        ckpt.save(1, {"params": params})
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers(dest="command"))
    out = tmp_path / "hf"
    argv = ["checkpoint", "export", str(tmp_path / "ckpt"), "--out", str(out)]
    args = parser.parse_args([*argv, "--dtype", "bf16", "--max-shard-size", "20KB"])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    _, weight_map, _ = read_index(out)
    n = len(set(weight_map.values()))
    assert n >= 3 and f"{n} safetensors file(s)" in printed
    got = flat(load_exported(out))
    for k, x in flat(params).items():
        np.testing.assert_array_equal(got[k], x.astype(ml_dtypes.bfloat16))
    # One file when no --max-shard-size is given: the single-file path is unchanged.
    args = parser.parse_args([*argv[:-1], str(tmp_path / "one.safetensors")])
    assert args.func(args) == 0
    assert flat(load_exported(tmp_path / "one.safetensors")).keys() == flat(params).keys()


def test_exported_at_stage3_on_8_loads_at_stage1_on_4(tmp_path):
    engine = make_engine(params=toy.make_params(seed=7))  # fp32, stage 3, 8 devices
    engine.params["blocks"]["w"] = engine.params["blocks"]["w"] * 1.5  # not what init gives
    engine.save_16bit_model(tmp_path / "hf", max_shard_size="30KB")
    report = run_child("weights_load_child.py", tmp_path / "hf", devices=4)
    assert report == {"devices": 4, "stage": 1, "identical": True, "placed": True}


def _write(path, tree):
    leaves = jax.tree.leaves(tree)
    write_leaves(path, leaf_entries(tree), lambda i: np.asarray(leaves[i]))
    return path


def test_mismatches_are_listed_in_one_error(tmp_path):
    params = {k: np.asarray(v) for k, v in flat(toy.make_params()).items()}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), toy.make_params())
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sh = jax.tree.map(
        lambda _: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), abstract
    )
    bad = dict(params)
    del bad["head.b"]  # missing
    bad["unused.x"] = np.zeros(3, np.float32)  # extra
    bad["odd"] = np.zeros((3, 5), np.float32)  # wrong shape
    path = _write(tmp_path / "bad.safetensors", bad)
    with pytest.raises(ValueError) as e:
        load_weights(path, abstract, sh)
    text = str(e.value)
    assert "1 parameter(s) have no tensor: 'head.b'" in text
    assert "1 tensor(s) match no parameter: 'unused.x'" in text
    assert "'odd': the parameter is (5, 3), 'odd' in the file is (3, 5)" in text
    # Each alone, through initialize.
    for name, change, message in [
        ("missing", lambda d: d.pop("embed"), "have no tensor: 'embed'"),
        ("extra", lambda d: d.update(more=np.ones(2, np.float32)), "match no parameter: 'more'"),
        ("shape", lambda d: d.update(embed=np.ones((12, 8), np.float32)), "shape(s) differ"),
    ]:
        d = dict(params)
        change(d)
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            make_engine(init_from=_write(tmp_path / f"{name}.safetensors", d))
    # Other names: a name map (dict or function) from the parameter's path to the file's name.
    renamed = {"model." + k: v for k, v in params.items()}
    path = _write(tmp_path / "renamed.safetensors", renamed)
    loaded = load_weights(path, abstract, sh, name_map=lambda p: "model." + p)
    np.testing.assert_array_equal(np.asarray(loaded["embed"]), params["embed"])
    loaded = load_weights(path, abstract, sh, name_map={k: "model." + k for k in params})
    np.testing.assert_array_equal(np.asarray(loaded["odd"]), params["odd"])


def test_export_and_import_memory_stay_within_a_few_leaves(tmp_path):
    leaf = (512, 4096)
    n = 16
    params = {f"layer{i}": {"w": np.full(leaf, i, np.float32)} for i in range(n)}
    with Checkpointer(tmp_path / "big", async_save=False) as ckpt:
        ckpt.save(1, {"params": params})
    del params
    leaf_kib = 512 * 4096 * 4 // 1024
    # A fixed mmap threshold makes glibc hand every large buffer back when it is freed; with
    # its default (a threshold that grows), freed leaves stay resident and the marks drift by
    # 2-4 leaves between runs. Measured here: export 2 leaves (the read leaf and its cast
    # copy), import 1 leaf above the loaded params, writing sharded arrays 1 leaf; loading the
    # whole file first would cost 16 leaves.
    peaks = run_child(
        "weights_memory_child.py",
        tmp_path / "big",
        tmp_path,
        timeout=400,
        env={"MALLOC_MMAP_THRESHOLD_": "65536"},
    )
    print("peak KiB above the start (import: above the loaded params):", peaks, "leaf", leaf_kib)
    for what, peak in peaks.items():
        assert peak < 3 * leaf_kib, (what, peak, leaf_kib)
    got = load_exported(tmp_path / "bfloat16")
    np.testing.assert_array_equal(got["layer5"]["w"], np.full(leaf, 5, ml_dtypes.bfloat16))
    _, weight_map, _ = read_index(tmp_path / "float32")
    assert len(set(weight_map.values())) == 8  # 2 leaves of 8.4 MB per 20 MB file


def test_each_shard_reads_only_its_own_bytes(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    tree = {
        "a": rng.normal(size=(16, 8)).astype(np.float32),  # sharded on its leading dim
        "b": rng.normal(size=(4, 16, 8)).astype(np.float32),  # beside a layer dim: 4 ranges each
        "c": rng.normal(size=(5, 3)).astype(np.float32),  # replicated: read whole
    }
    path = _write(tmp_path / "w.safetensors", tree)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    P = jax.sharding.PartitionSpec
    specs = {"a": P("data"), "b": P(None, "data"), "c": P()}
    sh = {k: jax.sharding.NamedSharding(mesh, s) for k, s in specs.items()}
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in tree.items()}
    reads = []
    preadv = os.preadv

    def counting(fd, buffers, offset):
        n = preadv(fd, buffers, offset)
        reads.append(n)
        return n

    monkeypatch.setattr(os, "preadv", counting)
    loaded = load_weights(path, abstract, sh)
    for k, x in tree.items():
        np.testing.assert_array_equal(np.asarray(loaded[k]), x)
        assert loaded[k].sharding == sh[k]
    # a: 8 reads of its 8 rows; b: per device one range per layer; c: whole, once per
    # distinct shard (jax asks once for a replicated leaf; at most once per device).
    c_reads = (sum(reads) - tree["a"].nbytes - tree["b"].nbytes) / tree["c"].nbytes
    assert c_reads in range(1, 9)
    assert len(reads) == 8 + 8 * 4 + c_reads
