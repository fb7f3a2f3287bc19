"""The closed-form estimate with 16-bit optimizer state (``bf16.bf16_optimizer_states``).

Adam's two moments rest in bfloat16 (2 bytes each) while the fp32 master stays 4 bytes, so the
optimizer state is K = 8 bytes a parameter instead of the ZeRO paper's K = 12. Psi = 1e9
parameters on N = 8 devices (one node); every expected number is integer arithmetic from
16-bit params 2 Psi, grads 2 Psi and optimizer state K Psi, each divided by N where the stage
shards it.
"""

import argparse

import pytest
from cli_runs import run_cli

from jzero import memory
from jzero.cli import memory as cli_memory
from jzero.costs import Dtypes, ModelShape, ParallelDims

PSI, N = 1_000_000_000, 8
PSI_E, E, EP = 750_000_000, 8, 4
MODEL, LAYOUT = ModelShape(PSI), ParallelDims(N)  # the estimate's plain case
GB = 10**9


def states(stage, psi, n, k):
    """(params, grads, optimizer state) bytes per device of ``psi`` parameters over ``n``
    devices at ``stage`` with K = ``k``. Integer arithmetic."""
    params = 2 * psi // (n if stage >= 3 else 1)
    grads = 2 * psi // (n if stage >= 2 else 1)
    opt = k * psi // (n if stage >= 1 else 1)
    return params, grads, opt


def test_bf16_state_per_stage_device_bytes_by_hand():
    e = memory.estimate(MODEL, LAYOUT, dtypes=Dtypes(optimizer="bf16"))
    assert e.optimizer_bytes == 8 and e.optimizer_dtype == "bf16"
    # stage 0 (2+2+8) Psi; 1: 4 Psi + 8 Psi/N; 2: 2 Psi + 10 Psi/N; 3: 12 Psi/N
    expected = {
        0: 12 * PSI,
        1: 4 * PSI + 8 * PSI // N,
        2: 2 * PSI + 10 * PSI // N,
        3: 12 * PSI // N,
    }
    assert expected == {0: 12 * GB, 1: 5 * GB, 2: 3_250_000_000, 3: 1_500_000_000}
    for stage, want in expected.items():
        row = e.row(stage)
        assert row.device_bytes == want
        names = ("params", "grads", "optimizer state")
        got = tuple(row.device.get(k, 0) for k in names)
        assert got == states(stage, PSI, N, 8)
    # only the optimizer state shrinks: params and grads are the fp32 state's
    fp32 = memory.estimate(MODEL, LAYOUT)
    for stage in range(4):
        a, b = e.row(stage).device, fp32.row(stage).device
        assert a.get("params") == b.get("params") and a.get("grads") == b.get("grads")
        assert b["optimizer state"] - a["optimizer state"] == 4 * PSI // (N if stage else 1)


def test_bf16_state_offload_host_and_nvme_rows_use_k8():
    e = memory.estimate(MODEL, LAYOUT, dtypes=Dtypes(optimizer="bf16"))
    fp32 = memory.estimate(MODEL, LAYOUT)
    nodes, per_node = 1, 8
    # stage 3 optimizer offload: (4 + K) Psi / nodes x 1.5 on the host (16 with fp32)
    assert e.row(3, "optimizer").host_bytes == 12 * PSI // nodes * 3 // 2 == 18 * GB
    assert fp32.row(3, "optimizer").host_bytes == 16 * PSI // nodes * 3 // 2
    # stage 3 optimizer + params: (6 + K) Psi / nodes x 1.5 (18 with fp32)
    assert e.row(3, "optimizer+params").host_bytes == 14 * PSI // nodes * 3 // 2 == 21 * GB
    assert fp32.row(3, "optimizer+params").host_bytes == 18 * PSI // nodes * 3 // 2
    # stages 1-2: Psi x max(4 N, 4 + K) x 1.5; with N = 8 the 4 N of fp32 gradients dominates
    assert e.row(1, "optimizer").host_bytes == PSI * 32 * 3 // 2
    # N = 1: max(4, 12) = 12
    one = memory.estimate(ModelShape(PSI), ParallelDims(1), dtypes=Dtypes(optimizer="bf16"))
    assert one.row(1, "optimizer").host_bytes == PSI * 12 * 3 // 2
    assert (
        memory.estimate(ModelShape(PSI), ParallelDims(1)).row(1, "optimizer").host_bytes
        == PSI * 16 * 3 // 2
    )
    # the device side of offload is unchanged (16-bit params only)
    assert e.row(1, "optimizer").device_bytes == fp32.row(1, "optimizer").device_bytes
    # nvme: 4 buffers of min(sub_group_size, Psi/N) x K x 1.5 per device; disk 2 K Psi / nodes
    nvme = e.row(3, "nvme")
    assert nvme.host_bytes == 4 * (PSI // N) * 8 * 3 // 2 * per_node == 48 * GB
    assert nvme.disk == 2 * 8 * PSI // nodes == 16 * GB
    assert fp32.row(3, "nvme").disk == 2 * 12 * PSI // nodes
    # the host's fp32 model while loading is not optimizer state: unchanged
    assert e.row(0).host == fp32.row(0).host == {"loading": 4 * PSI * per_node * 3 // 2}


def test_default_and_fp32_are_todays_numbers_and_bfloat16_is_an_alias():
    today = memory.estimate(MODEL, LAYOUT)
    assert today.optimizer_bytes == 12 and today.optimizer_dtype == "fp32"
    for stage in range(4):
        assert today.row(stage).device_bytes == sum(states(stage, PSI, N, 12))
    stages = [today.row(s).device_bytes for s in range(4)]
    assert stages == [16 * GB, 5_500_000_000, 3_750_000_000, 2 * GB]
    fp32 = memory.estimate(MODEL, LAYOUT, dtypes=Dtypes(optimizer="fp32"))
    assert fp32 == today and fp32.table() == today.table()
    alias = memory.estimate(MODEL, LAYOUT, dtypes=Dtypes(optimizer="bfloat16"))
    bf16 = memory.estimate(MODEL, LAYOUT, dtypes=Dtypes(optimizer="bf16"))
    assert alias == bf16 and alias.optimizer_dtype == "bf16"
    assert bf16.rows != today.rows


def test_experts_split_adds_up_with_bf16_state():
    e = memory.estimate(
        ModelShape(PSI, experts=E, expert_params=PSI_E),
        ParallelDims(N, expert=EP),
        dtypes=Dtypes(optimizer="bf16"),
    )
    names = ("params", "grads", "optimizer state")
    for stage in range(4):
        row = e.row(stage)
        expert = states(stage, PSI_E // EP, N // EP, 8)
        dense = states(stage, PSI - PSI_E, N, 8)
        assert tuple(row.device[f"expert {k}"] for k in names) == expert
        assert tuple(row.device[k] for k in names) == dense
        assert row.expert_bytes == sum(expert) and row.dense_bytes == sum(dense)
        assert row.device_bytes == row.expert_bytes + row.dense_bytes
    # E_p = 4: a device holds 1.875e8 expert parameters sharded over 2 devices
    assert e.row(1).expert_bytes == 4 * 187_500_000 + 8 * 187_500_000 // 2 == 1_500_000_000
    assert e.row(1).dense_bytes == 4 * 250_000_000 + 8 * 250_000_000 // 8 == 1_250_000_000
    # stage 3: 12 Psi/N over experts and dense together, as without experts
    assert e.row(3).device_bytes == 12 * PSI // N
    # host rows add up too: stage 3 optimizer offload (4 + K) Psi / nodes x 1.5
    assert e.row(3, "optimizer").host_bytes == pytest.approx(12 * PSI * 1.5)
    # with E_p = 1 the experts are plain parameters: the totals are those without experts
    one = memory.estimate(
        ModelShape(PSI, experts=E, expert_params=PSI_E),
        ParallelDims(N, expert=1),
        dtypes=Dtypes(optimizer="bf16"),
    )
    plain = memory.estimate(MODEL, LAYOUT, dtypes=Dtypes(optimizer="bf16"))
    for stage in range(4):
        assert one.row(stage).device_bytes == pytest.approx(plain.row(stage).device_bytes)
    assert "(stage 3: 12 Psi_e/N, " in e.table()


def test_table_states_k():
    bf16 = memory.estimate(MODEL, LAYOUT, dtypes=Dtypes(optimizer="bf16")).table()
    assert (
        "device: ZeRO paper, mixed-precision Adam with 16-bit optimizer state (K = 8: fp32 "
        "master 4 + bf16 moments 2 + 2, bf16.bf16_optimizer_states): stage 0 12 Psi, stage 1 "
        "4 Psi + 8 Psi/N, stage 2 2 Psi + 10 Psi/N, stage 3 12 Psi/N"
    ) in bf16
    assert "K = 12" not in bf16
    assert "max(4 N, 12) x 1.5;" in bf16
    assert "4 LL / 12 Psi/nodes x 1.5" in bf16 and "4 LL / 14 Psi/nodes x 1.5" in bf16
    assert "x 8 B x 1.5); disk 2 x 8 Psi/nodes." in bf16
    fp32 = memory.estimate(MODEL, LAYOUT).table()
    assert "mixed-precision Adam (K = 12): stage 0 16 Psi, stage 1 4 Psi + 12 Psi/N" in fp32
    assert "max(4 N, 16) x 1.5;" in fp32 and "disk 2 x 12 Psi/nodes." in fp32
    assert "K = 8" not in fp32


def test_estimate_cli_optimizer_dtype(capsys):
    argv = ["estimate", "--params", "1B", "--devices", "8"]
    assert run_cli([*argv, "--optimizer-dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert out == memory.estimate(MODEL, LAYOUT, dtypes=Dtypes(optimizer="bf16")).table() + "\n"
    assert "(K = 8: fp32 master 4 + bf16 moments 2 + 2, bf16.bf16_optimizer_states)" in out
    stage1 = next(line for line in out.splitlines() if line.split()[:2] == ["1", "none"])
    assert stage1.split()[2] == "4.66"  # 5 GB in GiB
    assert run_cli([*argv, "--optimizer-dtype", "fp32"]) == 0
    assert capsys.readouterr().out == memory.estimate(MODEL, LAYOUT).table() + "\n"
    assert run_cli(argv) == 0
    assert "(K = 12)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        run_cli([*argv, "--optimizer-dtype", "fp16"])
    assert "invalid choice: 'fp16'" in capsys.readouterr().err
    parser = argparse.ArgumentParser(prog="jzero")
    cli_memory.add_commands(parser.add_subparsers(dest="command"))
    est = parser._subparsers._group_actions[0].choices["estimate"]
    help_text = " ".join(est.format_help().split())
    assert "--optimizer-dtype {fp32,bf16}" in help_text
    assert "bf16.bf16_optimizer_states" in help_text


@pytest.mark.parametrize("bad", ["fp16", "float32", "", None, 8])
def test_bad_optimizer_dtype_is_a_clear_error(bad):
    with pytest.raises(ValueError) as e:
        memory.estimate(MODEL, LAYOUT, dtypes=Dtypes(optimizer=bad))
    assert str(e.value) == (
        f"optimizer_dtype: {bad!r} is not allowed; it must be one of 'fp32', 'bf16', "
        "'bfloat16'. Pass 'fp32' (the default, K = 12 bytes of optimizer state a parameter) "
        "or 'bf16' for bf16.bf16_optimizer_states (K = 8)."
    )
