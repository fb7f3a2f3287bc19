"""Checkpoint integrity: flipped bytes (bit rot) are named on restore, export and
``inspect --verify``; records written before checksums still restore; export never writes
through a pre-existing ``<out>.tmp``."""

import json
import os
import shutil
import zlib

import jax
import numpy as np
import pytest
import toy

import jzero.weights.export
from jzero import cli
from jzero.checkpoint import Checkpointer, CheckpointError
from jzero.weights import export_checkpoint, load_exported

RECORD = "jzero_files.json"


def state_of(step):
    return {"step": np.int32(step), "params": toy.make_params(seed=step)}


def target():
    """Every leaf replicated over the 8 devices (restore needs shardings, not a plan)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=replicated),
        state_of(0),
    )


def assert_restores(directory, step):
    state, meta = Checkpointer(directory).restore(target(), step=step)
    assert meta == {"step": step}
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(state_of(step)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A directory holding steps 1 and 2, written once per module."""
    directory = tmp_path_factory.mktemp("integrity") / "ckpt"
    with Checkpointer(directory, async_save=False) as ckpt:
        for step in (1, 2):
            assert ckpt.save(step, state_of(step), meta={"step": step})
    return directory


@pytest.fixture
def copy(saved, tmp_path):
    """A private copy of the saved directory, free to damage."""
    directory = tmp_path / "copy"
    shutil.copytree(saved, directory)
    return directory


def flip(directory, step):
    """Flips 4 bytes in the middle of the step's largest state file (its size stays); returns
    the file's path relative to the step."""
    step_dir = directory / str(step)
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file()]
    big = max(files, key=lambda p: p.stat().st_size)
    size = big.stat().st_size
    with open(big, "r+b") as f:
        f.seek(size // 2)
        raw = f.read(4)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in raw))
    assert big.stat().st_size == size
    return big.relative_to(step_dir).as_posix()


def verify_cli(capsys, directory, *extra):
    capsys.readouterr()
    status = cli.main(["checkpoint", "inspect", str(directory), "--verify", *extra])
    return status, capsys.readouterr().out


def test_the_record_holds_a_checksum_per_file(saved):
    record = json.loads((saved / "1" / RECORD).read_text())
    assert record["format"] == 2
    assert any(rel.startswith("state/") for rel in record["files"])
    for rel, entry in record["files"].items():
        raw = (saved / "1" / rel).read_bytes()
        assert entry == {"size": len(raw), "crc32": f"{zlib.crc32(raw):08x}"}


def test_intact_checkpoint_verifies_ok(saved, capsys):
    status, out = verify_cli(capsys, saved)
    assert status == 0, out
    for step in (1, 2):  # no --step: every step is verified
        files = len(json.loads((saved / str(step) / RECORD).read_text())["files"])
        assert f"step {step}: OK ({files} files, " in out
    assert "sizes and checksums match" in out and "DAMAGED" not in out
    status, out = verify_cli(capsys, saved, "--step", "1")
    assert status == 0 and "step 1: OK" in out and "step 2: OK" not in out
    assert_restores(saved, 2)


def test_flipped_bytes_are_named_by_restore_export_and_verify(copy, capsys, tmp_path):
    rel = flip(copy, 2)
    msg = (
        rf"Checkpoint step 2 in .* is damaged: the file {rel} has checksum [0-9a-f]{{8}} but "
        r"[0-9a-f]{8} was written \(its contents changed after the save\)\. Restore another "
        r"step \(\[1\]\)"
    )
    with pytest.raises(CheckpointError, match=msg):
        Checkpointer(copy).restore(target())
    with pytest.raises(CheckpointError, match=msg):
        export_checkpoint(copy, 2, tmp_path / "p.safetensors")
    assert not (tmp_path / "p.safetensors").exists()
    status, out = verify_cli(capsys, copy)
    assert status == 1
    assert f"step 2: DAMAGED: the file {rel} has checksum" in out
    assert "step 1: OK" in out
    assert verify_cli(capsys, copy, "--step", "2")[0] == 1
    assert verify_cli(capsys, copy, "--step", "1")[0] == 0  # only the named step is read
    # Without --verify inspect reads metadata only (the sizes still match) and exits 0.
    capsys.readouterr()
    assert cli.main(["checkpoint", "inspect", str(copy)]) == 0
    assert "DAMAGED" not in capsys.readouterr().out
    assert_restores(copy, 1)  # the other step is untouched


def test_every_damaged_file_is_listed(copy, capsys):
    rel = flip(copy, 1)
    record = json.loads((copy / "1" / RECORD).read_text())
    meta_file = next(r for r in record["files"] if r.startswith("meta/"))
    (copy / "1" / meta_file).unlink()
    status, out = verify_cli(capsys, copy)
    assert status == 1
    assert "step 1: DAMAGED (2 problems):" in out
    assert f"the file {meta_file} is missing" in out and f"the file {rel} has checksum" in out
    assert "step 2: OK" in out


def test_records_without_checksums_still_restore(copy, capsys):
    # A record written before checksums: sizes only.
    path = copy / "2" / RECORD
    record = json.loads(path.read_text())
    path.write_text(
        json.dumps({"format": 1, "files": {r: e["size"] for r, e in record["files"].items()}})
    )
    assert_restores(copy, 2)
    status, out = verify_cli(capsys, copy)
    assert status == 0, out
    assert "step 2: OK" in out and "saved before jzero recorded checksums" in out
    assert "step 1: OK" in out and "sizes and checksums match" in out
    # Its sizes are still checked.
    rel = next(r for r in record["files"] if r.startswith("state/"))
    with open(copy / "2" / rel, "ab") as f:
        f.write(b"x")
    with pytest.raises(CheckpointError, match=rf"damaged: the file {rel} has \d+ bytes but"):
        Checkpointer(copy).restore(target(), step=2)
    # A step with no record at all gets the structural check.
    (copy / "1" / RECORD).unlink()
    assert_restores(copy, 1)
    status, out = verify_cli(capsys, copy, "--step", "1")
    assert status == 0 and "step 1: OK (no file record" in out
    # A record from a newer jzero is refused by name, not misread.
    (copy / "1" / RECORD).write_text(json.dumps({"format": 99, "files": {}}))
    with pytest.raises(CheckpointError, match=r"has format 99, newer than this jzero reads"):
        Checkpointer(copy).restore(target(), step=1)


def test_export_never_writes_through_a_tmp_symlink(saved, tmp_path, monkeypatch):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    for name in ("p.safetensors", "p.npz"):
        out = out_dir / name
        os.symlink(victim, out_dir / (name + ".tmp"))
        assert export_checkpoint(saved, 2, out) == out
        assert victim.read_text() == "precious"
        assert os.readlink(out_dir / (name + ".tmp")) == str(victim)  # not ours: left alone
        loaded = load_exported(out)
        expected = state_of(2)["params"]
        for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(expected), strict=True):
            np.testing.assert_array_equal(a, np.asarray(b))
    # An output that is itself a symlink is replaced, not written through.
    os.symlink(victim, out_dir / "link.npz")
    export_checkpoint(saved, 2, out_dir / "link.npz")
    assert not (out_dir / "link.npz").is_symlink() and victim.read_text() == "precious"
    expected = {"p.safetensors", "p.safetensors.tmp", "p.npz", "p.npz.tmp", "link.npz"}
    assert {p.name for p in out_dir.iterdir()} == expected  # no temporary left behind

    # A failed write leaves nothing behind and touches nothing.
    def broken(f, entries, fetch):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(jzero.weights.export, "_write_npz", broken)
    with pytest.raises(OSError, match="disk full"):
        export_checkpoint(saved, 2, out_dir / "new.npz")
    assert {p.name for p in out_dir.iterdir()} == expected
    assert victim.read_text() == "precious"
