"""The closed-form estimate with a mixture of experts: expert and dense parameters counted apart.

Psi = 1e9 parameters of which Psi_e = 0.75e9 are the experts', on N = 8 devices, E = 8
experts, E_p in {1, 2, 4, 8}. A device holds Psi_e/E_p expert parameters, their states
ZeRO-sharded over the N/E_p devices of their expert data-parallel group; the dense
Psi_d = 0.25e9 over all N. Every expected number here is an integer computed from the ZeRO
paper's formula (2 bytes params, 2 bytes grads, 12 bytes optimizer state per parameter).
"""

import argparse

import pytest
from cli_runs import run_cli

from jzero import memory
from jzero.cli import memory as cli_memory
from jzero.costs import ModelShape, ParallelDims

PSI, PSI_E, N, E = 1_000_000_000, 750_000_000, 8, 8
PSI_D = PSI - PSI_E
MODEL, LAYOUT = ModelShape(PSI), ParallelDims(N)  # the estimate's plain case
GB = 10**9


def states(stage, psi, n):
    """(params, grads, optimizer state) bytes per device of ``psi`` parameters sharded over
    ``n`` devices at ``stage``: the ZeRO paper, K = 12. Integer arithmetic."""
    params = 2 * psi // (n if stage >= 3 else 1)
    grads = 2 * psi // (n if stage >= 2 else 1)
    opt = 12 * psi // (n if stage >= 1 else 1)
    return params, grads, opt


def moe(ep, device_memory=None, **layout):
    model = ModelShape(PSI, experts=E, expert_params=PSI_E)
    return memory.estimate(model, ParallelDims(N, expert=ep, **layout), device_memory)


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_expert_and_dense_states_per_device_are_the_formula_twice(stage, ep):
    row = moe(ep).row(stage)
    # Each device: Psi_e/E_p expert parameters over N/E_p devices, Psi_d over N.
    expert = states(stage, PSI_E // ep, N // ep)
    dense = states(stage, PSI_D, N)
    names = ("params", "grads", "optimizer state")
    assert {k: row.device[f"expert {k}"] for k in names} == dict(zip(names, expert, strict=True))
    assert {k: row.device[k] for k in names} == dict(zip(names, dense, strict=True))
    assert row.expert_bytes == sum(expert)
    assert row.dense_bytes == sum(dense)
    assert row.device_bytes == sum(expert) + sum(dense)


def test_the_hand_computed_numbers_of_each_stage():
    # E_p = 4: a device holds 2 experts, 1.875e8 parameters, sharded over 2 devices.
    rows = {s: moe(4).row(s) for s in range(4)}
    assert rows[0].expert_bytes == 16 * 187_500_000 == 3_000_000_000
    # Stage 1: expert params (2 bytes) and grads (2 bytes) of Psi_e/E_p whole, optimizer / 2.
    assert rows[1].device["expert params"] == 2 * PSI_E // 4 == 375_000_000
    assert rows[1].expert_bytes == 4 * 187_500_000 + 12 * 187_500_000 // 2 == 1_875_000_000
    assert rows[1].dense_bytes == 4 * PSI_D + 12 * PSI_D // N == 1_375_000_000
    assert rows[2].expert_bytes == 2 * 187_500_000 + 14 * 187_500_000 // 2 == 1_687_500_000
    # Stage 3: E_p x N/E_p = N, so the expert states are 16 Psi_e / N whatever E_p is.
    assert rows[3].expert_bytes == 16 * PSI_E // N == 1_500_000_000
    assert rows[3].dense_bytes == 16 * PSI_D // N == 500_000_000
    for ep in (1, 2, 8):
        assert moe(ep).row(3).expert_bytes == 1_500_000_000
    # Below stage 3 more expert parallelism means less: 16 Psi_e / E_p at stage 0.
    assert [moe(ep).row(0).expert_bytes for ep in (1, 2, 4, 8)] == [
        12_000_000_000,
        6_000_000_000,
        3_000_000_000,
        1_500_000_000,
    ]


def test_offload_rows_split_the_same_way():
    e = moe(4)
    p_e, n_e = PSI_E // 4, N // 4  # 1.875e8 expert parameters a device, over 2 devices
    # Stages 1-2 with optimizer offload keep the 16-bit params on the device.
    assert e.row(1, "optimizer").device == {"params": 2 * PSI_D, "expert params": 2 * p_e}
    # DeepSpeed's host memory, Psi x max(4 N, 16) x 1.5, for each part with its own N.
    host = PSI_D * max(4 * N, 16) * 1.5 + p_e * max(4 * n_e, 16) * 1.5
    assert e.row(1, "optimizer").host_bytes == host == 16_500_000_000
    # Stage 3: the device's shards; a node holds 16 Psi x 1.5 of both parts together.
    assert e.row(3, "optimizer").expert_bytes == 2 * p_e // n_e == 2 * PSI_E // N
    assert e.row(3, "optimizer").host_bytes == 16 * PSI * 1.5
    assert e.row(3, "optimizer+params").device_bytes == 0
    # No nvme rows beside expert parallelism (jzero's config refuses the combination) ...
    assert {r.offload for r in e.rows} == {"none", "optimizer", "optimizer+params"}
    assert "No nvme rows" in e.table()
    # ... and with E_p = 1 the experts are plain parameters: the nvme rows are there.
    assert "nvme" in {r.offload for r in moe(1).rows}


@pytest.mark.parametrize(
    "largest, layout, offload",
    [
        (0, {}, None),
        (50_000_000, {}, None),
        (0, {"replica": 2}, None),
        (0, {"pipe": 2}, None),
        (0, {"devices_per_node": 4}, "cpu"),
    ],
)
def test_one_expert_group_is_todays_estimate(largest, layout, offload):
    """E_p = 1 shards the experts over all N, as any parameter: the split adds up to the
    totals of the same Psi without experts, row for row (offload, host, disk too). (Beside
    tensor parallelism it does not: the experts stay whole over ``model``, as AutoTP leaves
    them, where dense parameters are split.)"""
    experts = ModelShape(PSI, largest, experts=E, expert_params=PSI_E)
    split = memory.estimate(experts, ParallelDims(N, expert=1, **layout), None, offload)
    plain = memory.estimate(ModelShape(PSI, largest), ParallelDims(N, **layout), None, offload)
    assert [(r.stage, r.offload) for r in split.rows] == [(r.stage, r.offload) for r in plain.rows]
    for a, b in zip(split.rows, plain.rows, strict=True):
        assert a.expert_bytes > 0 or a.offload == "optimizer+params"  # nothing on the device
        assert a.expert_bytes + a.dense_bytes == pytest.approx(b.device_bytes, rel=1e-12)
        assert a.device_bytes == pytest.approx(b.device_bytes, rel=1e-12)
        assert a.host_bytes == pytest.approx(b.host_bytes, rel=1e-12)
        assert (a.disk, a.comm_psi, a.cross_host_psi) == (b.disk, b.comm_psi, b.cross_host_psi)
        assert b.expert_bytes == 0 and b.dense_bytes == b.device_bytes


def test_the_recommendation_weighs_the_totals():
    # 3 GB, 2.7 usable: with E_p = 4 stage 2 (2.625 GB) fits; with E_p = 1 (3.75 GB) it
    # does not, and stage 3 (2 GB) is the lowest that does.
    assert moe(4, device_memory="3GB").recommendation.stage == 2
    assert moe(1, device_memory="3GB").recommendation.stage == 3
    assert moe(4, device_memory="3GB").recommendation.needed == 2_625_000_000


def test_counts_read_suffixes():
    a = memory.estimate(
        ModelShape("1B", experts=E, expert_params="750M"), ParallelDims(N, expert=4)
    )
    assert a.params == PSI and a.expert_params == PSI_E
    assert a.rows == moe(4).rows
    assert (
        memory.estimate(ModelShape("7.5e9"), ParallelDims(64)).rows
        == memory.estimate(ModelShape(7.5e9), ParallelDims(64)).rows
    )


def test_the_table_shows_expert_and_dense_columns_only_with_experts():
    plain = memory.estimate(MODEL, LAYOUT).table()
    assert "expert GiB" not in plain and "Psi_e" not in plain
    table = moe(4).table()
    header = table.splitlines()[1].split()
    assert header[:7] == ["stage", "offload", "device", "GiB", "expert", "GiB", "dense"]
    lines = table.splitlines()
    # stage 1: 3.25 GB = 1.875 expert + 1.375 dense, in GiB 3.03 = 1.75 + 1.28
    assert lines[4].split()[:5] == ["1", "none", "3.03", "1.75", "1.28"]
    assert lines[6].split()[:5] == ["3", "none", "1.86", "1.40", "0.47"]  # 2 = 1.5 + 0.5 GB
    assert "E = 8 per MoE layer, E_p = 4 (each device holds 2 of them)" in lines[0]
    assert "Psi_e = 7.5e+08 expert and Psi_d = 2.5e+08 dense parameters" in lines[0]
    assert "expert data-parallel group of N/E_p = 2 device(s)" in table
    bars = dict((label, device) for label, device, _ in moe(4).bars())
    assert bars["1\nnone"]["expert optimizer state"] == 12 * PSI_E // N


def test_estimate_cli_prints_the_expert_and_dense_columns(capsys):
    argv = ["estimate", "--params", "1e9", "--devices", "8", "--experts", "8"]
    assert run_cli([*argv, "--expert-parallel", "4", "--expert-params", "0.75e9"]) == 0
    out = capsys.readouterr().out
    assert out == moe(4).table() + "\n"
    header = out.splitlines()[1]
    assert "expert GiB" in header and "dense GiB" in header
    assert run_cli([*argv, "--ep", "8", "--expert-params", "0.75B"]) == 0
    assert capsys.readouterr().out == moe(8).table() + "\n"
    # without the expert flags, nothing changes
    assert run_cli(["estimate", "--params", "1e9", "--devices", "8"]) == 0
    assert capsys.readouterr().out == memory.estimate(MODEL, LAYOUT).table() + "\n"
    with pytest.raises(ValueError) as e:
        run_cli(argv)
    assert str(e.value) == (
        "--experts 8 needs --expert-params, the parameters of all the experts together (part of "
        "--params), e.g. --expert-params 6e9: they are sharded apart from the dense parameters. "
        "Pass --expert-params, or leave out --experts."
    )
    parser = argparse.ArgumentParser(prog="jzero")
    cli_memory.add_commands(parser.add_subparsers(dest="command"))
    help_text = parser._subparsers._group_actions[0].choices["estimate"].format_help()
    for flag in ("--experts", "--expert-params", "--expert-parallel", "--ep"):
        assert flag in help_text
    assert "expert data-parallel groups" in help_text


def test_bad_expert_arguments_are_clear_errors():
    def error(experts=E, expert_params=PSI_E, expert_parallel=1, **layout):
        model = ModelShape(PSI, experts=experts, expert_params=expert_params)
        with pytest.raises(ValueError) as e:
            memory.estimate(model, ParallelDims(N, expert=expert_parallel, **layout))
        return str(e.value)

    assert error(expert_parallel=3) == (
        "expert_parallel: 3 does not divide devices=8; the mesh is {data: N/E_p, expert: E_p}. "
        "Pass an expert_parallel among the divisors of 8 (1, 2, 4, 8)."
    )
    assert error(experts=6, expert_parallel=4) == (
        "expert_parallel: 4 does not divide the 6 experts; each device of the expert axis holds "
        "an equal share of them. Pass an expert_parallel among the divisors of 6 (1, 2, 3, 6); "
        "of them, 1, 2 also divide 8."
    )
    assert error(expert_parallel=4, replica=4) == (
        "expert_parallel: 4 does not divide the 2 devices of each of the 4 replica groups; the "
        "mesh is {data: N/E_p, expert: E_p}. Pass an expert_parallel among the divisors of 2 "
        "(1, 2)."
    )
    assert error(expert_params=2e9) == (
        "expert_params: 2e+09 is more than params=1e+09; the experts' parameters are part of "
        "params (the whole model's count). Pass an expert_params of at most 1e+09, or a params "
        "that includes the experts."
    )
    assert error(expert_params=0).startswith("experts: 8 needs expert_params, the parameters")
    assert error(experts=0).startswith("expert_params: 7.5e+08 needs experts, the number")
    assert error(experts=0, expert_params=0, expert_parallel=2) == (
        "expert_parallel: 2 splits experts over devices, but experts is 0; pass experts (the "
        "experts of each MoE layer, e.g. 8) and expert_params (their parameters, part of "
        "params), or expert_parallel=1."
    )
    assert error(experts=-1) == (
        "experts: -1 is not allowed; it must be the whole number of experts of each MoE layer, "
        "e.g. 8, or 0 (no mixture of experts)."
    )
    assert error(expert_parallel=0) == (
        "expert_parallel: 0 is not allowed; it must be a positive integer, e.g. 4."
    )
    assert error(expert_params="many") == (
        "expert_params: 'many' is not allowed; it must be a positive number, e.g. 6e9."
    )
    assert error(expert_parallel=2, model=2, pipe=2, seq=2) == (
        "devices=8 can't be split into 1 replica group(s) x tensor_parallel=2 x "
        "sequence_parallel=2 x pipeline=2 x expert_parallel=2; pass sizes whose product "
        "divides 8."
    )
    # E_p = 2 beside T = 2 and P = 2 (the mesh {pipe: 2, data: 1, expert: 2, model: 2}): the
    # experts stay whole over `model`, so a device holds Psi_e / (P E_p) of them, sharded over
    # its expert data-parallel group of N / (T P E_p) = 1 device; the dense Psi_d / (T P) over
    # the N / (T P) = 2 devices of data x expert.
    composed = moe(2, model=2, pipe=2).row(3)
    assert composed.expert_bytes == 16 * (PSI_E // 2 // 2)
    assert composed.device["params"] == 2 * (PSI_D // 4) // 2
    # E_p = 1 beside T = 2 and P = 2: each device holds its stage's experts whole, Psi_e / P,
    # sharded over N / (T P) = 2 devices.
    assert moe(1, model=2, pipe=2).row(3).expert_bytes == 16 * (PSI_E // 2) // 2
