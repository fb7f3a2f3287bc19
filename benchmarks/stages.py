"""ZeRO stages 0-3 on a GPT-like scanned model: memory, communication and step time per stage.

Run: ``python benchmarks/stages.py`` (8 virtual CPU devices are set up when no accelerator is
present; ``--stages`` and ``--hosts-stages`` pick the stages, all four by default). Every figure
comes from the compiled program or from live arrays:

* params / opt state: bytes of the live arrays resident on device 0 (``addressable_shards``);
* grads: the gradient accumulator per device from the plan (it is a temporary of the step);
* args / temp: ``compiled.memory_analysis()`` (per device); temp AC: the same stage with
  ``activation_checkpointing: {policy: full}`` (each layer keeps only its input);
* ZeRO: the closed forms for fp32 Adam (params 4, grads 4, moments 8 bytes a parameter):
  stage 0 16 Psi, stage 1 4 Psi + 4 Psi + 8 Psi/N, stage 2 4 Psi + 12 Psi/N, stage 3 16 Psi/N;
* collectives: full-buffer bytes per step by kind, from the compiled HLO (loops counted by
  trip count), against ZeRO's volumes in units of Psi (parameter bytes);
* layout copies: copies and transposes adjacent to a collective in the compiled step
  (``jzero.hlo.layout_copies``), count and MiB: re-layouts that cost memory bandwidth each step;
* time: the median step time of each stage against the floor, a hand-written plain JAX
  data-parallel step (``benchmarks/plain_dp.py``: replicated params, batch sharded over
  ``data``, the same clipping and optax update; for stage 3, whose layer scan is
  rematerialised, the same step under ``jax.checkpoint``), at each ``--devices`` count. The
  variants run interleaved (``--repeats`` rounds of ``--steps`` steps each, every variant once
  per round), so a slow phase of the machine hits them all alike;
* across hosts: each stage on ``{data: N}``, on ``mesh: {replica: 2, data: N/2}`` (hybrid
  sharding) and, at stage 3, with ZeRO++ hpZ (``zero_hpz_partition_size: N/2``): full-buffer
  bytes per step by where the collective's device groups lie, read from the compiled program
  (``jzero.hlo.collectives_by_axes``), with the first and second half of the devices taken as
  two hosts: within a host, or across them. The per-device model state shows what hybrid
  sharding costs in memory;
* mixed precision (``bf16: {enabled: true}``): the live bytes per device of the 16-bit params,
  the float32 master weights and the moments, plus the 16-bit gradient, against the ZeRO
  paper's K = 12 formulas (16 Psi, 4 Psi + 12 Psi/N, 2 Psi + 14 Psi/N, 16 Psi/N with Psi the
  parameter count); and the collective bytes with ``communication_data_type`` bf16 against
  fp32, read from the program after SPMD partitioning (the CPU compiler later widens 16-bit
  collectives to float32 because it has no 16-bit ones; a GPU runs them as they are).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jzero  # noqa: E402
from jzero.demo import gpt  # noqa: E402
from jzero.hlo import (  # noqa: E402
    collectives,
    collectives_by_axes,
    layout_copies,
    program_text,
)
from jzero.plan import model_state_bytes  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plain_dp import plain_dp_step  # noqa: E402

MB = 1 << 20


def device0_bytes(tree) -> int:
    d0 = jax.devices()[0]
    total = 0
    for x in jax.tree.leaves(tree):
        for s in x.addressable_shards:
            if s.device == d0:
                total += s.data.nbytes
    return total


def interleaved_medians(runs: dict, steps: int, repeats: int) -> dict:
    """Median seconds a step of each variant: ``repeats`` rounds, each timing ``steps`` steps of
    every variant in turn (after one untimed step each)."""
    times = {name: [] for name in runs}
    for run in runs.values():
        jax.block_until_ready(run())
    for _ in range(repeats):
        for name, run in runs.items():
            for _ in range(steps):
                t = time.perf_counter()
                jax.block_until_ready(run())
                times[name].append(time.perf_counter() - t)
    return {name: float(np.median(ts)) for name, ts in times.items()}


def step_times(
    params, loss, batch, n: int, steps: int, repeats: int, stages=(0, 1, 2, 3)
) -> tuple[dict, dict]:
    """Interleaved step times of plain data parallelism and ``stages`` on the first ``n``
    devices, and each stage's layout copies (count, bytes)."""
    mesh = jzero.make_mesh(n, devices=jax.devices()[:n])
    tbs = batch["tokens"].shape[0]
    runs, copies = {}, {}
    for stage in stages:
        config = {
            "train_batch_size": tbs,
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        }
        options = jzero.InitOptions(mesh=mesh)
        engine = jzero.initialize(params, loss, optax.adamw(1e-3), config, options=options)
        found = layout_copies(engine.lower(batch).compile())
        copies[stage] = (len(found), sum(c.bytes for c in found))
        runs[stage] = lambda e=engine: e.train_step(batch)["loss"]
    tx = optax.adamw(1e-3)
    runs["plain"] = plain_dp_step(params, tx, loss, mesh, batch, clip=1.0)
    runs["plain+remat"] = plain_dp_step(params, tx, loss, mesh, batch, clip=1.0, remat=True)
    return interleaved_medians(runs, steps, repeats), copies


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="timed steps a round, per variant")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--devices", default="2,8", help="device counts for the step-time table")
    ap.add_argument("--no-bf16", action="store_true", help="skip the mixed-precision tables")
    ap.add_argument(
        "--hosts-stages", default="0,1,2,3", help="stages of the across-hosts table (default all)"
    )
    ap.add_argument("--stages", default="0,1,2,3", help="stages of the other tables (default all)")
    args = ap.parse_args(argv)
    stages = [int(s) for s in args.stages.split(",") if s]

    cfg = gpt.GPTConfig(
        vocab_size=256,
        seq_len=args.seq_len,
        num_layers=args.layers,
        num_heads=4,
        d_model=args.d_model,
        d_ff=4 * args.d_model,
    )
    params = gpt.init_params(jax.random.key(0), cfg)
    loss = lambda p, b: gpt.loss_fn(p, b, cfg)
    n = jax.device_count()
    tbs = args.micro_batch * n
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, 256, (tbs, args.seq_len + 1), dtype=np.int32)}
    psi_elems = sum(x.size for x in jax.tree.leaves(params))
    psi = psi_elems * 4
    print(
        f"GPT: {args.layers} layers, d_model {args.d_model}, {psi_elems:,} parameters "
        f"(Psi = {psi / MB:.2f} MiB fp32), {n} {jax.devices()[0].platform} devices, "
        f"global batch {tbs} x {args.seq_len} tokens, AdamW"
    )
    zero = {
        0: (16, "2 Psi all-reduce"),
        1: (8 + 8 / n, "Psi RS + Psi AG"),
        2: (4 + 12 / n, "Psi RS + Psi AG"),
        3: (16 / n, "3 Psi (2 AG + RS)"),
    }
    rows = []
    for stage in stages:
        config = {
            "train_batch_size": tbs,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        }
        engine = jzero.initialize(params, loss, optax.adamw(1e-3), config)
        compiled = engine.lower(batch).compile()
        mem = compiled.memory_analysis()
        coll = collectives(compiled)
        grads = model_state_bytes(engine.plan)["grads"]
        p_b, o_b = device0_bytes(engine.params), device0_bytes(engine.opt_state)
        copies = layout_copies(compiled)
        ac = {**config, "activation_checkpointing": {"policy": "full"}}
        ac_engine = jzero.initialize(params, loss, optax.adamw(1e-3), ac, abstract=True)
        ac_temp = ac_engine.lower(batch).compile().memory_analysis().temp_size_in_bytes
        rows.append(
            (
                stage,
                p_b / MB,
                grads / MB,
                o_b / MB,
                (p_b + grads + o_b) / MB,
                zero[stage][0] * psi_elems / MB,
                mem.argument_size_in_bytes / MB,
                mem.temp_size_in_bytes / MB,
                coll["all-reduce"].wire_bytes / psi,
                coll["reduce-scatter"].bytes / psi,
                coll["all-gather"].bytes / psi,
                zero[stage][1],
                len(copies),
                sum(c.bytes for c in copies) / MB,
                ac_temp / MB,
            )
        )

    print("\nPer-device memory (MiB)")
    hdr = "stage  params   grads  opt state  model state  ZeRO formula     args     temp  temp AC"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(
            f"{r[0]:>5}  {r[1]:6.2f}  {r[2]:6.2f}  {r[3]:9.2f}  {r[4]:11.2f}  {r[5]:12.2f}"
            f"  {r[6]:7.2f}  {r[7]:7.2f}  {r[14]:7.2f}"
        )
    print(
        "(temp AC: with activation_checkpointing: {policy: full}; without it stage 3 still "
        "rematerialises its layer scan, saving matmul outputs)"
    )
    print("\nCollective bytes per step, in units of Psi (all-reduce counted twice, as on the wire)")
    hdr = "stage  all-reduce  reduce-scatter  all-gather  total  ZeRO"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(
            f"{r[0]:>5}  {r[8]:10.3f}  {r[9]:14.3f}  {r[10]:10.3f}  {r[8] + r[9] + r[10]:5.2f}"
            f"  {r[11]}"
        )
    print("\nLayout copies around collectives (copies/transposes next to a collective)")
    hdr = "stage  count     MiB"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r[0]:>5}  {r[12]:5d}  {r[13]:6.2f}")
    if n % 2 == 0 and n > 2:
        hosts_stages = [int(s) for s in args.hosts_stages.split(",") if s]
        across_hosts(params, loss, batch, tbs, psi, n, hosts_stages)
    for count in [int(c) for c in args.devices.split(",") if c]:
        if count > n:
            print(f"\n(skipping {count} devices: this machine has {n})")
            continue
        sub = {"tokens": batch["tokens"][: args.micro_batch * count]}
        times, copies = step_times(params, loss, sub, count, args.steps, args.repeats, stages)
        floor, remat_floor = times["plain"], times["plain+remat"]
        print(
            f"\nStep time on {count} devices, global batch {args.micro_batch * count}: median of "
            f"{args.repeats} interleaved rounds x {args.steps} steps"
        )
        hdr = "variant       ms/step  vs plain DP  vs plain DP+remat  layout copies MiB"
        print(hdr)
        print("-" * len(hdr))
        print(f"{'plain DP':<12}  {floor * 1e3:7.1f}  {1.0:11.2f}  {floor / remat_floor:17.2f}")
        print(
            f"{'plain+remat':<12}  {remat_floor * 1e3:7.1f}  {remat_floor / floor:11.2f}"
            f"  {1.0:17.2f}"
        )
        for stage in stages:
            t = times[stage]
            print(
                f"{'stage ' + str(stage):<12}  {t * 1e3:7.1f}  {t / floor:11.2f}  "
                f"{t / remat_floor:17.2f}  {copies[stage][1] / MB:17.2f}"
            )
        print("(targets: stages 0-2 <= 1.05 x plain DP; stage 3 <= 1.25 x plain DP+remat)")
    sys.stdout.flush()
    if not args.no_bf16:
        mixed_precision(params, loss, batch, tbs, psi_elems, n, stages)


def across_hosts(params, loss, batch, tbs, psi, n, stages=(0, 1, 2, 3)) -> None:
    """Collective bytes within and across two halves of the devices (two hosts), per stage, on
    a flat data axis, a hybrid mesh and (stage 3) hpZ; and the model state per device."""
    hosts = {"replica": 2, "data": n // 2}
    variants = [(stage, "flat", {}) for stage in stages]
    variants += [(stage, "hybrid", {"mesh": hosts}) for stage in stages]
    if 3 in stages:
        variants.append((3, "hpZ", {"zero": {"zero_hpz_partition_size": n // 2}}))
    rows = []
    for stage, name, extra in variants:
        zero = {"stage": stage, "stage3_param_persistence_threshold": 0, **extra.get("zero", {})}
        config = {"train_batch_size": tbs, "zero_optimization": zero}
        if "mesh" in extra:
            config["mesh"] = extra["mesh"]
        engine = jzero.initialize(params, loss, optax.adamw(1e-3), config, abstract=True)
        # Device ids are mesh positions: the first n/2 are one host, the rest the other.
        by = collectives_by_axes(engine.lower(batch).compile(), hosts)
        within = sum(
            s.wire_bytes for a, st in by.items() if "replica" not in a for s in st.values()
        )
        across = sum(s.wire_bytes for a, st in by.items() if "replica" in a for s in st.values())
        state = sum(model_state_bytes(engine.plan).values())
        rows.append((stage, name, within / psi, across / psi, state / MB))
    print(
        f"\nAcross hosts: collective bytes per step in units of Psi (all-reduce counted twice), "
        f"devices 0-{n // 2 - 1} and {n // 2}-{n - 1} taken as two hosts"
    )
    hdr = "stage  mesh     within a host  across hosts  model state MiB/device"
    print(hdr)
    print("-" * len(hdr))
    for stage, name, within, across, state in rows:
        print(f"{stage:>5}  {name:<7}  {within:13.3f}  {across:12.3f}  {state:22.2f}")
    print(
        f"(hybrid: {{replica: 2, data: {n // 2}}}, gradient shards all-reduced across hosts; "
        f"hpZ: zero_hpz_partition_size {n // 2}, gathers within a host, optimizer state over "
        "all devices)"
    )


def mixed_precision(params, loss, batch, tbs, psi_elems, n, stages=(0, 1, 2, 3)) -> None:
    """Per-device bytes under bf16 against K = 12, and collective bytes by communication dtype."""
    k12 = {0: 16, 1: 4 + 12 / n, 2: 2 + 14 / n, 3: 16 / n}
    mem_rows, comm_rows = [], []
    for stage in stages:
        by_comm = {}
        for comm in ("bf16", "fp32"):
            config = {
                "train_batch_size": tbs,
                "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                "bf16": {"enabled": True},
                "communication_data_type": comm,
            }
            engine = jzero.initialize(params, loss, optax.adamw(1e-3), config)
            by_comm[comm] = collectives(program_text(engine.lower(batch)))
            if comm == "bf16":
                st = engine.state
                live = [device0_bytes(t) for t in (st.params, st.master, st.opt_state)]
                grads = model_state_bytes(engine.plan)["grads"]
                total = sum(live) + grads
                mem_rows.append((stage, *[b / MB for b in live], grads / MB, total / MB))
        kinds = ("all-reduce", "reduce-scatter", "all-gather")
        wide, narrow = by_comm["fp32"], by_comm["bf16"]
        comm_rows.append(
            (
                stage,
                *[wide[k].wire_bytes / MB for k in kinds],
                *[narrow[k].wire_bytes / MB for k in kinds],
            )
        )
    print("\nMixed precision (bf16, AdamW): per-device memory (MiB) against K = 12")
    hdr = "stage  params  master  moments   grads  measured  K=12 formula"
    print(hdr)
    print("-" * len(hdr))
    for stage, p_b, m_b, o_b, g_b, total in mem_rows:
        formula = k12[stage] * psi_elems / MB
        print(
            f"{stage:>5}  {p_b:6.2f}  {m_b:6.2f}  {o_b:7.2f}  {g_b:6.2f}  {total:8.2f}"
            f"  {formula:12.2f}"
        )
    print("\nCollective bytes per step (MiB, all-reduce counted twice), bf16 compute")
    hdr = "stage  comm fp32: AR     RS     AG  |  comm bf16: AR     RS     AG  | bf16/fp32"
    print(hdr)
    print("-" * len(hdr))
    for stage, *b in comm_rows:
        ratio = sum(b[3:]) / sum(b[:3])
        print(
            f"{stage:>5}  {b[0]:13.2f} {b[1]:6.2f} {b[2]:6.2f}  |  {b[3]:13.2f} {b[4]:6.2f}"
            f" {b[5]:6.2f}  | {ratio:9.2f}"
        )
    print("(stage 3 gathers the 16-bit parameters it holds whatever the setting)")


if __name__ == "__main__":
    main()
