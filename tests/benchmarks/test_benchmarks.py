"""Every script under benchmarks/ that the documentation's figures come from runs and prints its
tables, so that none can rot. A smoke run proves the script runs, not its figures: each runs
once, on a tiny model, with the fewest cells its tables need, on 8 virtual CPU devices (the
run's XLA flags and compilation cache, ``procs.device_env``) whose code generator runs at its
cheapest level, as the GPU checks' ``--smoke`` children do: no figure a smoke run prints is
compared to the bit. The runs a test names with ``@smoke`` share one child process
(``tests/support/bench_smoke.py``: JAX and jzero imported once, each script run as its own
``__main__``, what it changed put back), every test of this module among them. The claims
behind the figures are the library's tests' (named beside what each smoke run leaves out); a
claim no library test makes stays asserted here."""

import math
import subprocess

import bench_smoke
import pytest

RUNS: dict[str, tuple[str, list[str]]] = {}  # test name -> its script and arguments


def smoke(script, *args):
    """Registers the test's run of ``benchmarks/<script>.py ARGS`` in the shared child process
    (``{out}`` in an argument: the runs' folder, ``smoke_runs``); the test reads what it printed
    from the ``ran`` fixture."""

    def register(test):
        RUNS[test.__name__] = (script, list(args))
        return test

    return register


@pytest.fixture(scope="module")
def smoke_runs(request, tmp_path_factory):
    """The ``@smoke`` runs of the tests selected in this module, in one child process: a folder
    of ``<test>.out``, ``.err`` and ``.json`` (``bench_smoke.py``)."""
    here = {item.name for item in request.session.items if item.module is request.module}
    out = tmp_path_factory.mktemp("bench_smoke")
    runs = [
        [name, script, [a.replace("{out}", str(out)) for a in args]]
        for name, (script, args) in RUNS.items()
        if name in here
    ]
    bench_smoke.launch(runs, out, bench_smoke.smoke_env(), timeout=300 * len(runs))
    return out


@pytest.fixture
def ran(request, smoke_runs):
    """What the test's ``@smoke`` run printed (it must have exited 0)."""
    name = request.node.name
    out, err = bench_smoke.result(smoke_runs, name)
    return subprocess.CompletedProcess(RUNS[name], 0, out, err)


# Stage 3 alone (the script's loop is the same for every stage): the layout copies of stages 1-2
# are tests/plan/test_layout.py's, hybrid sharding's bytes across hosts
# tests/distributed/test_hybrid.py's (test_only_gradient_shards_cross_the_replica_axis,
# test_hpz_gathers_within_groups_and_trains_like_stage3).
@smoke(
    "stages",
    *("--no-bf16", "--layers", "2", "--d-model", "32", "--seq-len", "8", "--steps", "1"),
    *("--repeats", "1", "--devices", "2", "--stages", "3", "--hosts-stages", "3"),
)
def test_stages_benchmark_prints_memory_collectives_copies_and_step_times(ran):
    out = ran.stdout
    for title in (
        "Per-device memory",
        "Collective bytes",
        "Layout copies",
        "Across hosts",
        "Step time on 2",
    ):
        assert title in out
    # Hybrid sharding: stage 3 sends a quarter of its gradient bytes (2 Psi / 4 devices per
    # host, plus the leaves ZeRO leaves whole) across the two hosts, the flat mesh all of it.
    hosts = [line.split() for line in out.split("Across hosts")[1].splitlines()[3:6]]
    across = {(r[0], r[1]): float(r[3]) for r in hosts}
    assert set(across) == {("3", "flat"), ("3", "hybrid"), ("3", "hpZ")}
    assert across[("3", "hybrid")] < across[("3", "flat")] / 3
    assert across[("3", "hpZ")] < across[("3", "flat")] / 3
    timed = out.split("Step time on 2")[1].splitlines()[3:6]
    names = [line[:12].strip() for line in timed]
    assert names == ["plain DP", "plain+remat", "stage 3"]
    assert all(float(line[12:].split()[0]) > 0 for line in timed)  # ms/step
    # On 2 devices the 2 stacked layers shard on their leading dimension; on 8 (the memory
    # tables) their state rests with layers and rows merged: stage 3 has no layout copies
    # around its collectives on either (8 devices had 28 of them before the merge).
    assert timed[2].split()[-1] == "0.00"
    copies = [line.split() for line in out.split("Layout copies")[1].splitlines()[3:4]]
    assert copies == [["3", "0", "0.00"]]


@smoke(
    "stage3_layers",
    *("--layers", "2", "--width", "64", "--batch", "8", "--ac-batch", "512"),
    *("--ac-width", "32", "--smoke"),
)
def test_stage3_layers_benchmark_prints_each_way_of_writing_the_model(ran):
    tables = ran.stdout.split("\n\n")
    rows = tables[0].splitlines()[3:]
    names = [row[:22].strip() for row in rows]
    assert names == [
        "scan (stacked layers)",
        "Python loop, pytree",
        "Python loop, Linen",
        "nnx.List of layers",
    ]
    assert all(float(row.split()[-1]) > 0 for row in rows)
    # Activation checkpointing (--smoke: stage 0; stage 3's per-layer checkpointing is
    # tests/rewrite/test_activation_checkpointing.py's
    # test_a_python_loop_is_checkpointed_layer_by_layer): the scan and the loop.
    ac = [row.split() for row in tables[1].splitlines()[3:5]]
    assert [(r[-5], r[-4]) for r in ac] == [("layers)", "0"), ("pytree", "0")]
    assert all(float(r[-3]) > 0 and float(r[-2]) > 0 for r in ac)
    # The model's own jax.checkpoint per layer, no section: on CPU no less than the plain loop.
    own = tables[1].splitlines()[5]
    assert own.startswith("loop + jax.checkpoint")
    assert float(own.split()[4]) >= float(ac[1][-3])
    # Gather settings (--smoke: the defaults; what reuse and reshard_after_forward: false save
    # is tests/step/test_stage3_any_model.py's
    # test_reshard_after_forward_false_gathers_once_and_trains_the_same and
    # test_max_reuse_distance_keeps_what_is_reused_within_it).
    gathers = [row.split() for row in tables[2].splitlines()[3:]]
    assert [g[0] for g in gathers] == ["(defaults)"] and float(gathers[0][-2]) > 0


# No offload (the base of the ratios) and the NVMe tier (the one whose files the script reads).
# The host tiers are config alone here: where their state rests and that they train the same are
# tests/plan/test_offload.py's
# test_optimizer_offload_rests_in_pinned_host_and_trains_bit_identically and
# tests/nvme/test_offload_tiers.py's
# test_subgroups_stream_the_update_in_order_with_the_same_bits and
# test_host_compute_updates_each_group_where_it_rests_with_the_same_bits; the smoke run of
# benchmarks/gpu_check.py (test_gpu_checks.py) runs them through a script.
@smoke(
    "offload",
    *("--stages", "2", "--offload", "none,nvme", "--layers", "1", "--d-model", "32"),
    *("--seq-len", "8", "--steps", "1"),
)
def test_offload_benchmark_prints_no_offload_against_the_nvme_tier(ran):
    timed = ran.stdout.split("Step time")[1].splitlines()[3:5]
    rows = {line.split()[1]: line.split() for line in timed}
    assert list(rows) == ["none", "nvme"]
    assert all(float(r[2]) > 0 for r in rows.values())  # ms/step
    assert float(rows["nvme"][-1]) > 0  # the NVMe tier's files hold the state
    assert float(rows["none"][-1]) == 0
    assert "Per-device memory" in ran.stdout


def _rows(out):
    """The rows of the markdown table in ``out``, as dicts by its header."""
    lines = [line for line in out.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    return [dict(zip(cells[0], row, strict=True)) for row in cells[2:]]


# The loop form (the scan's is the same cell code, another model), 4 cells.
@smoke("compile_time", "--smoke", "--forms", "loop")
def test_compile_time_benchmark_prints_the_table_and_the_compilations(ran):
    rows = [line.split() for line in ran.stdout.splitlines()[3:]]
    assert [r[:2] for r in rows] == [["loop", "2"]]
    for r in rows:  # seconds (compiles) for plain jit, plain DP, stage 0 and stage 3, and
        # jzero's ratios to plain DP and plain jit
        assert [r[3], r[7], r[11]] == ["(2)", "(2)", "(2)"] and r[5].startswith("(")
        assert all(float(r[i]) > 0 for i in (2, 4, 6, 10))
        assert all(r[i].endswith("x") for i in (8, 9, 12, 13))


# T = 2 alone: what Megatron's split saves per device is
# tests/distributed/test_tensor_parallel.py's
# test_jzero_plan_reports_per_device_bytes_and_the_model_axis_traffic and
# test_model_axis_collectives_stay_within_model_groups_and_zero_within_data; Ulysses's
# all-to-alls and ZeRO over data x seq are tests/distributed/test_sequence_parallel_gpt.py's.
@smoke("tensor_parallel", "--smoke", "--tp", "2", "--sp", "1")
def test_tensor_parallel_benchmark_prints_bytes_per_tp_size(ran):
    rows = _rows(ran.stdout)
    assert [(r["T"], r["S"], r["stage"], r["mesh"]) for r in rows] == [
        ("2", "1", "1", "{data: 4, model: 2}")
    ]
    (two,) = rows
    assert two["vs T=S=1"] == "-"  # no T = 1 row to compare with
    # The model axis carries the row-parallel all-reduces; no seq axis at S = 1.
    assert float(two["model MiB"]) > 0 and float(two["seq MiB"]) == 0
    assert float(two["model state MiB"]) > 0 and float(two["ZeRO MiB"]) > 0  # ZeRO's collectives
    assert float(two["temp MiB"]) > 0 and float(two["ms/step"]) > 0


@smoke("sequence_parallel", "--smoke")
def test_sequence_parallel_benchmark_prints_temporaries_falling_by_about_s(ran):
    rows = [line.strip("|").split("|") for line in ran.stdout.splitlines() if line[:3] == "| 6"]
    (row,) = rows  # sequence length 64, one sequence per data group
    one, four, ratio = (float(c) for c in row[1:])
    assert four < one and ratio < 0.5  # a quarter of the tokens and heads' scores a device


# P = 2 with 1F1B alone: 1F1B's temporaries against GPipe's are
# tests/distributed/test_pipeline.py's
# test_1f1b_keeps_p_micro_batches_of_activations_where_gpipe_keeps_m, the model state against
# P = 1 its test_jzero_train_runs_the_built_in_gpt_on_two_stages.
@smoke("pipeline", "--smoke", "--pipeline", "2", "--schedules", "1f1b,interleaved_1f1b,zero_bubble")
def test_pipeline_benchmark_prints_the_bubble_memory_and_bytes_between_stages(ran):
    rows = _rows(ran.stdout)
    assert [(r["P"], r["schedule"], r["mesh"]) for r in rows] == [
        ("2", kind, "{pipe: 2, data: 4}") for kind in ("1f1b", "interleaved_1f1b", "zero_bubble")
    ]
    f1b, inter, zb = rows
    assert float(f1b["bubble"]) == 0.2  # (P-1)/(M+P-1) at M = 4, P = 2
    assert float(inter["bubble"]) == 0.111  # (P-1)/(MV+P-1), V = 2
    assert float(zb["bubble"]) == 0.077  # 1 idle slot of 13 a stage
    # In lockstep (forward 1, backward 2, a split backward's passes 1 each): 18, 16, 13.
    assert [float(r["lockstep"]) for r in rows] == [18, 16, 13]
    # Activations move between the stages; ZeRO's collectives within each stage's data group.
    assert float(f1b["pipe MiB"]) > 0 and float(f1b["ZeRO MiB"]) > 0
    # Each micro-batch forward once and back once per (chunk) boundary, nothing sent in idle
    # slots; interleaving's chunks cross twice as many boundaries.
    assert {r["sent/need"] for r in rows} == {"1.00"}
    assert float(inter["pipe MiB"]) > float(f1b["pipe MiB"])
    # 2 in flight (P) under 1F1B and zero-bubble; 5 chunks of half a stage interleaved.
    assert [r["in flight"] for r in rows] == ["2", "2.5", "2"]
    for r in rows:
        assert all(float(r[k]) > 0 for k in ("model state MiB", "temp MiB", "ms/step"))


# E_p = 2 alone, and the dense twin: the expert leaves split over the expert axis, the
# all-to-alls and E_p = 2 training as E_p = 1 are tests/distributed/test_moe.py's
# (test_expert_leaves_rest_split_over_expert_and_at_stage_3_over_data_too,
# test_the_compiled_step_holds_two_all_to_alls_per_layer_each_way,
# test_moe_toy_equals_the_dense_reference) and tests/models/test_gpt_moe.py's
# test_expert_parallel_stage3_step_equals_one_device; the temporaries' linear growth with the
# tokens tests/distributed/test_moe_dispatch.py's
# test_step_temporaries_grow_linearly_with_the_tokens.
@smoke("moe", "--smoke", "--ep", "2")
def test_moe_benchmark_prints_expert_bytes_the_all_to_alls_and_tokens_per_device(ran):
    by_ep, rest = ran.stdout.split("Tokens per device")
    scaled, grouped = rest.split("Experts' MLP")
    rows = _rows(by_ep)
    assert [(r["E_p"], r["stage"], r["mesh"]) for r in rows] == [("2", "1", "{data: 4, expert: 2}")]
    (two,) = rows
    # Tokens reach their experts by all-to-all where there is an expert axis.
    assert float(two["all-to-all MiB"]) > 0
    assert float(two["expert MiB"]) > 0 and float(two["dense MiB"]) > 0
    assert float(two["ZeRO MiB"]) > 0 and float(two["ms/step"]) > 0
    assert math.isfinite(float(two["loss"])) and float(two["loss"]) > 0
    assert "dense twin" in by_ep
    # 1x and 4x the tokens per device, with a capacity and dropless
    cells = {(r["mode"], int(r["tokens/device"])): r for r in _rows(scaled)}
    assert set(cells) == {(m, t) for m in ("capacity", "dropless") for t in (16, 64)}
    for mode in ("capacity", "dropless"):
        one, four = cells[(mode, 16)], cells[(mode, 64)]
        # buffers linear in the tokens (printed to 3 decimals)
        a2a = float(four["all-to-all MiB"]), float(one["all-to-all MiB"])
        assert math.isclose(a2a[0], 4 * a2a[1], rel_tol=0.02) and a2a[1] > 0
        assert float(four["temp MiB"]) > float(one["temp MiB"]) > 0
    assert all(float(cells[("dropless", t)]["dropped"]) == 0 for t in (16, 64))
    forms = [(r["tokens"], r["form"]) for r in _rows(grouped)]
    names = ["padded, capacity 1.25", "padded, dropless", "ragged_dot"]
    assert forms == [(t, f) for t in ("16", "64") for f in names]


# AdamW's fp32 state against Muon's; the bf16 and 8-bit AdamW rows are config alone here: their
# state bytes are tests/optim/test_optim_state16.py's
# test_bf16_state_halves_the_adam_moments_per_device and tests/optim/test_optim_state8.py's
# test_8bit_state_is_under_a_third_of_the_fp32_state_per_device.
@smoke("optimizers", "--smoke", "--optimizers", "AdamW fp32 state,Muon + AdamW")
def test_optimizers_benchmark_prints_state_bytes_and_muons_traffic(ran):
    rows = {r["optimizer"]: r for r in _rows(ran.stdout)}
    assert list(rows) == ["AdamW fp32 state", "Muon + AdamW"]
    state = {k: float(r["opt-state MiB"]) for k, r in rows.items()}
    # Muon keeps one moment for its matrices (AdamW's two for the rest).
    assert state["Muon + AdamW"] < 0.75 * state["AdamW fp32 state"]
    # Muon's exchange is the only traffic AdamW's step lacks; AdamW moves no all-to-all.
    assert float(rows["AdamW fp32 state"]["all-to-all MiB"]) == 0
    assert float(rows["Muon + AdamW"]["collectives MiB"]) > float(
        rows["AdamW fp32 state"]["collectives MiB"]
    )
    assert "Muon adds" in ran.stdout and "Psi beside ZeRO's 2 Psi" in ran.stdout
    assert all(float(r["ms/step"]) > 0 and float(r["eval loss"]) > 0 for r in rows.values())


@smoke("training_curves", "--smoke", "--plot", "{out}/curves.png")
def test_training_curves_benchmark_draws_the_monitors_series(ran, smoke_runs):
    plot = smoke_runs / "curves.png"
    lines = [line for line in ran.stdout.splitlines() if line.startswith("| ")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[1:]]
    # The table is the CSV monitor's series: every step's loss and MFU (6 steps of 16 samples),
    # the eval losses at 0 and every 3 steps.
    assert [r[0] for r in rows] == ["0", "16", "32", "48", "64", "80", "96"]
    assert [bool(r[2]) for r in rows] == [True, False, False, True, False, False, True]
    assert all(r[1] and float(r[3]) > 0 for r in rows[1:])
    assert "measured f32 matmul rate" in ran.stdout
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# Each layout's exactness, its axes' collectives and its checkpoint are
# tests/distributed/test_compose_two.py's and test_compose_three.py's.
@smoke("composition", "--smoke")
def test_composition_benchmark_prints_state_temporaries_and_bytes_per_axis(ran):
    out = ran.stdout.splitlines()
    head = next(i for i, ln in enumerate(out) if ln.startswith("layout"))
    names = [n.strip() for n in out[head].split("  ") if n.strip()]
    starts = [out[head].index(n) for n in names]
    rows = {}
    for line in out[head + 2 : head + 4]:
        cells = [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
        rows[cells[0]] = dict(zip(names, cells, strict=True))
    assert list(rows) == ["data only", "model x pipe x expert"]
    plain, three = rows.values()
    assert plain["mesh"] == "{data: 8}" and plain["model MiB"] == plain["pipe MiB"] == "-"
    assert three["mesh"] == "{pipe: 2, data: 1, expert: 2, model: 2}"
    for axis in ("model", "pipe", "expert"):  # each of its axes carries its own collectives
        assert float(three[f"{axis} MiB"]) > 0, axis
    assert three["seq MiB"] == three["replica MiB"] == "-"
    for row in rows.values():
        assert float(row["state MiB"]) > 0 and float(row["temp MiB"]) > 0


# Which layout the search keeps within a budget is tests/engine/test_auto_layout.py's; here the
# script (gpu_check.sh's auto_layout section) runs: 8 rows over 8 devices, a budget of the
# rank-first candidate's own need keeps it.
@smoke("auto_layout", "--smoke")
def test_auto_layout_benchmark_keeps_a_layout_and_times_it_beside_the_next(ran):
    out = ran.stdout.splitlines()
    (line,) = [x for x in out if x.lstrip().startswith("8 x 16")]
    kept, nxt = line.split("|")[0], line.split("|")[1]
    assert "data 8, stage 0" in kept and float(kept.split()[-1]) > 0, line
    assert float(nxt.split()[-1]) > 0 and "stage" in nxt, line


# That a resumed run reads exactly the uninterrupted run's batches, on 8 and 4 devices, is
# tests/train/test_resume_anywhere.py's; here the script runs its three children.
@smoke("data_wait", "--smoke")
def test_data_wait_benchmark_prints_the_wait_share_and_resumes_on_8_and_4_devices(ran):
    out = ran.stdout.splitlines()
    (wait,) = [line for line in out if line.startswith("steps after the first")]
    assert wait.endswith("%") and float(wait.split()[-2]) > 0  # the loop's seconds
    head = next(i for i, line in enumerate(out) if "start to first step" in line)
    rows = [line.split() for line in out[head + 1 : head + 3]]
    assert [r[0] for r in rows] == ["8", "4"] and all(float(r[1]) > 0 for r in rows), out


# What the rows hold (packing, segment ids, positions) is tests/data/'s.
@smoke("data_loader", "--smoke")
def test_data_loader_benchmark_prints_packed_tokens_per_second(ran):
    out = ran.stdout.splitlines()
    rows = [line.split() for line in out if line.startswith(("npy", "jsonl"))]
    assert [(r[0], r[1]) for r in rows] == [
        ("npy", "1"),
        ("npy", "2"),
        ("jsonl+tokenizer.json", "1"),
        ("jsonl+tokenizer.json", "2"),
    ]
    assert all(float(r[-1].replace(",", "")) > 0 for r in rows)


# What the watchdog reports is tests/distributed/test_watchdog.py's; here the script runs.
@smoke("watchdog", "--smoke")
def test_watchdog_benchmark_prints_its_share_of_a_step(ran):
    out = ran.stdout.splitlines()
    (row,) = [line for line in out if line.startswith("watchdog a step")]
    assert row.endswith("%") and float(row.split()[-2]) >= 0
    assert any(line.startswith("agreement, once") for line in out)


# Smoke: length 64 in blocks and chunks of 16. That the tiled forms hold no [T, T] scores,
# [B, T, V] logits or whole MLP layer is tests/ops/test_long_sequence_gpt.py's
# test_the_functional_gpt_with_blocks_and_chunks_equals_the_plain_one.
@smoke("long_sequence", "--smoke")
def test_long_sequence_benchmark_prints_temporaries_per_form(ran):
    out = ran.stdout
    (row,) = [line.strip("|").split("|") for line in out.splitlines() if line[:4] == "| 64"]
    plain, attention, loss, mlp = (float(c) for c in row[1:])
    assert loss < plain and mlp <= loss  # the [64, 512] logits were the largest temporaries


# Smoke: a one-layer GPT, lengths from and up to 32 (one probe a row). The figures' claims
# (no [T, T] scores, logits or MLP layer; the ring's permutes over `context` only; the tiled
# forms' smaller temporaries) are tests/ops/test_long_sequence_gpt.py's,
# tests/distributed/test_context_parallel.py's and the smoke test above.
# --gpu too (gpu_check.sh's long_context section), whose tables on CPU are the XLA path.
# Rotary positions, as the figures in docs/benchmarks.md.
@smoke(
    "long_sequence",
    *("--smoke", "--budget", "2MiB", "--most", "32", "--first", "32"),
    *("--steps", "1", "--gpu", "--positions", "rotary"),
)
def test_long_sequence_benchmark_finds_each_techniques_longest_sequence_and_the_rings_bytes(ran):
    out = ran.stdout
    gpu, out = out.split("### Longest sequence")
    assert "| XLA (no GPU) |" in gpu and "| 64 | 8 |" in gpu, gpu
    longest, ring = out.split("### Ring against Ulysses")
    rows = [line.strip("|").split("|") for line in longest.splitlines() if line[:3] == "| +"]
    rows = [line.strip("|").split("|") for line in longest.splitlines() if "| plain" in line] + rows
    lengths = [int(r[2]) for r in rows]
    assert len(lengths) == 6 and lengths[0] > 0, out
    # Each technique keeps at least the length of the one before it (offload changes nothing
    # measurable on CPU).
    assert lengths == sorted(lengths) and lengths[-1] > 0, lengths
    moved = {r[0].strip(): float(r[3]) for r in
             (line.strip("|").split("|") for line in ring.splitlines()[4:6])}  # fmt: skip
    assert set(moved) == {"ring attention", "Ulysses (seq 2)"} and min(moved.values()) > 0, out


# One stage of the tiny Llama-shaped model on 8 devices: the agreement itself (model state
# within 10%, the same stage recommended) is tests/memory/test_memory_agreement.py's, the
# DeepSpeed column's formulas tests/memory/test_memory_presets.py's.
@smoke(
    "estimate_vs_plan",
    *("--tiny", "--devices", "8", "--seq-len", "16", "--stages", "1"),
    *("--device-memory", "40MB"),
)
def test_estimate_vs_plan_benchmark_prints_the_three_figures_side_by_side(ran):
    out = ran.stdout
    header = out.splitlines()[1]
    for column in ("estimate state", "plan state", "plan peak", "DeepSpeed GB"):
        assert column in header
    row = out.splitlines()[3].split()
    assert row[0] == "1" and row[-1] != "-"  # DeepSpeed has a figure for stage 1
    assert "recommended for 40MB: estimate stage 1, plan stage 1" in out
