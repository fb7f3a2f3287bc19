"""The closed-form estimate with bf16 master weights (``bf16.bf16_master_weights_and_grads``).

The bf16 params are the masters, so the fp32 copy's 4 bytes leave K: K = 8 with fp32 moments,
K = 4 with bf16 moments too (``--optimizer-dtype bf16``), DeepSpeed 0.19's 2 + 2 + 4 = 8 bytes
a parameter at stage 0. Psi = 1e9 parameters on N = 8 devices (one node); every expected
number is integer arithmetic.
"""

import argparse

import pytest
from cli_runs import run_cli
from test_memory_state16 import states

from jzero import memory
from jzero.cli import memory as cli_memory
from jzero.costs import Dtypes, ModelShape, ParallelDims

PSI, N = 1_000_000_000, 8
MODEL, LAYOUT = ModelShape(PSI), ParallelDims(N)  # the estimate's plain case
GB = 10**9


@pytest.mark.parametrize(("optimizer_dtype", "k"), [("fp32", 8), ("bf16", 4)])
def test_bf16_masters_take_4_bytes_out_of_k_at_every_stage(optimizer_dtype, k):
    e = memory.estimate(MODEL, LAYOUT, dtypes=Dtypes(optimizer=optimizer_dtype, master="bf16"))
    assert e.optimizer_bytes == k and e.master_dtype == "bf16"
    with_copy = memory.estimate(MODEL, LAYOUT, dtypes=Dtypes(optimizer=optimizer_dtype))
    assert with_copy.optimizer_bytes == k + 4 and with_copy.master_dtype == "fp32"
    names = ("params", "grads", "optimizer state")
    for stage in range(4):
        row = e.row(stage)
        assert tuple(row.device.get(n, 0) for n in names) == states(stage, PSI, N, k)
        assert row.device_bytes == sum(states(stage, PSI, N, k))
        # exactly the fp32 copy's 4 bytes a parameter less, sharded as the optimizer state is
        saved = with_copy.row(stage).device_bytes - row.device_bytes
        assert saved == 4 * PSI // (N if stage >= 1 else 1)
    if k == 4:  # DeepSpeed 0.19's bf16 masters + bf16 moments: 2 + 2 + 4 = 8 bytes at stage 0
        got = [e.row(s).device_bytes for s in range(4)]
        assert got == [8 * GB, 4 * PSI + 4 * PSI // N, 2 * PSI + 6 * PSI // N, 8 * PSI // N]
        assert got == [8 * GB, 4_500_000_000, 2_750_000_000, GB]


def test_bf16_masters_host_rows_use_k_and_list_no_nvme():
    e = memory.estimate(MODEL, LAYOUT, dtypes=Dtypes(optimizer="bf16", master="bf16"))  # K = 4
    # stage 3 optimizer offload (4 + K) Psi / nodes x 1.5; optimizer + params (6 + K)
    assert e.row(3, "optimizer").host_bytes == 8 * PSI * 3 // 2 == 12 * GB
    assert e.row(3, "optimizer+params").host_bytes == 10 * PSI * 3 // 2 == 15 * GB
    # K = 8, N = 1: max(4, 12)
    one = memory.estimate(ModelShape(PSI), ParallelDims(1), dtypes=Dtypes(master="bf16"))
    assert one.row(1, "optimizer").host_bytes == 12 * PSI * 3 // 2
    # jzero refuses the NVMe tier with bf16 masters: no nvme rows, and the table says so
    assert not [r for r in e.rows if r.offload == "nvme"]
    assert [r for r in memory.estimate(MODEL, LAYOUT).rows if r.offload == "nvme"]
    assert "No nvme rows: jzero's bf16 master weights do not compose with the NVMe tier" in (
        e.table()
    )


def test_table_and_cli_master_dtype(capsys):
    table = memory.estimate(MODEL, LAYOUT, dtypes=Dtypes(optimizer="bf16", master="bf16")).table()
    assert (
        "device: ZeRO paper's Adam with bf16 master weights (K = 4: no fp32 master, bf16 "
        "moments 2 + 2, bf16.bf16_master_weights_and_grads): stage 0 8 Psi, stage 1 4 Psi + "
        "4 Psi/N, stage 2 2 Psi + 6 Psi/N, stage 3 8 Psi/N"
    ) in table
    fp32_moments = memory.estimate(MODEL, LAYOUT, dtypes=Dtypes(master="bf16")).table()
    assert "(K = 8: no fp32 master, fp32 moments 4 + 4, bf16.bf16_master" in fp32_moments
    argv = ["estimate", "--params", "1B", "--devices", "8"]
    assert run_cli([*argv, "--master-dtype", "bf16", "--optimizer-dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert out == table + "\n"
    stage0 = next(line for line in out.splitlines() if line.split()[:2] == ["0", "none"])
    assert stage0.split()[2] == "7.45"  # 8 GB in GiB
    assert run_cli([*argv, "--master-dtype", "fp32"]) == 0
    assert capsys.readouterr().out == memory.estimate(MODEL, LAYOUT).table() + "\n"
    with pytest.raises(SystemExit):
        run_cli([*argv, "--master-dtype", "fp16"])
    assert "invalid choice: 'fp16'" in capsys.readouterr().err
    parser = argparse.ArgumentParser(prog="jzero")
    cli_memory.add_commands(parser.add_subparsers(dest="command"))
    est = parser._subparsers._group_actions[0].choices["estimate"]
    help_text = " ".join(est.format_help().split())
    assert "--master-dtype {fp32,bf16}" in help_text
    assert "bf16.bf16_master_weights_and_grads" in help_text


def test_default_and_alias_and_bad_master_dtype():
    fp32 = memory.estimate(MODEL, LAYOUT, dtypes=Dtypes(master="fp32"))
    assert fp32 == memory.estimate(MODEL, LAYOUT)
    alias = memory.estimate(MODEL, LAYOUT, dtypes=Dtypes(master="bfloat16"))
    assert (
        alias == memory.estimate(MODEL, LAYOUT, dtypes=Dtypes(master="bf16"))
        and alias.master_dtype == "bf16"
    )
    with pytest.raises(ValueError) as e:
        memory.estimate(MODEL, LAYOUT, dtypes=Dtypes(master="fp16"))
    assert str(e.value) == (
        "master_dtype: 'fp16' is not allowed; it must be one of 'fp32', 'bf16', 'bfloat16'. "
        "Pass 'fp32' (the default, a 4-byte fp32 master copy in K) or 'bf16' for "
        "bf16.bf16_master_weights_and_grads (no copy: K drops by 4)."
    )
