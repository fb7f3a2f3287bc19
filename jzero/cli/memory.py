"""``jzero estimate`` and ``jzero plan``: the memory planner on the command line.

Decisions:

* :func:`add_commands` adds both subcommands to the ``jzero`` parser; each sets ``func(args)``
  returning the exit status. Bad values (sizes, counts, configs) raise ``ValueError`` from the
  library with the full message, and the ``jzero`` entry point prints it and exits with 2.
* ``estimate`` is pure arithmetic and never starts JAX. ``plan`` compiles the config's built-in
  GPT once per stage; with no accelerator it asks for ``--cpu-devices`` virtual CPU devices
  first, as ``jzero train`` does (:mod:`jzero.cli.devices`).
* The table goes to stdout; ``--plot FILE.png`` also writes the stacked-bar chart.
"""

from __future__ import annotations

import argparse
from typing import Any

from jzero import costs
from jzero.choices.pipeline import SCHEDULES
from jzero.cli import devices, logs

__all__ = ["add_commands"]

_ESTIMATE_HELP = """\
Per-device memory at ZeRO stages 0-3, closed-form: model states, and activations when the
transformer's shape is given.
Device memory without offload: the ZeRO paper with mixed-precision Adam (K = 12 bytes of
optimizer state per parameter): stage 0 16 Psi, stage 1 4 Psi + 12 Psi/N, stage 2
2 Psi + 14 Psi/N, stage 3 16 Psi/N bytes (Psi = --params, N = --devices), plus at stage 3
4 bytes per parameter of the largest layer (gathered at once).
Offload and host memory: DeepSpeed's estimate_zero2_model_states_mem_needs and
estimate_zero3_model_states_mem_needs with additional_buffer_factor 1.5, host memory per node:
stages 1-2 with optimizer offload 2 Psi on the device, Psi x max(4 N, 16) x 1.5 on the host;
stage 3 with optimizer offload 2 Psi/N + 4 LL on the device, 16 Psi / nodes x 1.5 on the host;
stage 3 with optimizer and parameter offload 4 LL on the device, 18 Psi / nodes x 1.5 on the
host (LL = --largest-layer-params); without offload the host holds 4 Psi x devices per node x
1.5 while the model loads (stage 3: the largest layer only).
Communication per step: stage 0 2 Psi (all-reduce), stages 1-2 2 Psi (reduce-scatter +
all-gather), stage 3 3 Psi. Sizes are printed in GiB (2^30 bytes), DeepSpeed's figures in its
own GB (bytes / 2^30); --device-memory 80GB is 80 x 10^9 bytes.
A published shape, with --preset (llama-2-7b, llama-3-8b, llama-3-70b, qwen2.5-7b,
mixtral-8x7b): its parameter count, largest layer, hidden size, layers, heads, vocabulary and
experts; flags given beside it win. The largest layer is the
largest matrix stage 3 gathers at once (jzero gathers each leaf apart, one layer's slice of a
stacked leaf at a time): without --preset or --largest-layer-params, a GPT's of --hidden
(the MLP's h x 4h) or the --vocab x --hidden embedding.
DeepSpeed's own figures, its estimate_zero2_model_states_mem_needs (stages 1-2: 2 Psi +
18 Psi/N; 2 Psi with the optimizer offloaded) and estimate_zero3_model_states_mem_needs
(stage 3: 4 LL + 18 Psi/N; 4 LL + 2 Psi/N; 4 LL, LL its largest module) are a column of their
own beside jzero's.
Activations, with --seq-len, --micro-batch, --hidden, --layers and --heads (s, b, h, L, a), by
default those jzero runs: blockwise attention (no [s, s] scores) without dropout masks;
--attention plain --dropout on gives the paper's accounting: Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models" (arXiv:2205.05198),
section 4, no tensor or sequence parallelism: per layer and device
s*b*h*(34 + 5*a*s/h) bytes without recomputation. That formula assumes 16-bit activations
(2 bytes) and 1-byte dropout masks (2*s*b*h + a*s^2*b of the total); with
--activation-dtype fp32 jzero doubles the 16-bit part and keeps the masks at 1 byte:
66*s*b*h + 9*a*s^2*b per layer. With full activation checkpointing (AC) only each layer's
input is kept, 2*s*b*h bytes per layer in 16-bit (4*s*b*h in fp32), and jzero adds one layer's
activations, rebuilt in the backward pass. Embeddings and logits are not counted; ZeRO does
not shard activations, so every option carries the same term. The table then shows totals
without and with AC, and the recommendation weighs the levers by cost: the lowest stage
without AC, then AC (about one extra forward pass), then offload. Without the shape,
activations are not counted (the --margin is left for them): use `jzero plan` to measure.
Mixture of experts, with --experts E, --expert-params Psi_e (the parameters of all experts,
part of --params) and --expert-parallel E_p (expert_parallel.autoep_size; the mesh
{data: N/E_p, expert: E_p}): the expert and dense parameters are counted apart, as DeepSpeed's
expert data-parallel groups shard them. A device holds E/E_p experts (Psi_e/E_p parameters),
whose states ZeRO shards only over the N/E_p devices of its group; the dense Psi - Psi_e is
sharded over all N. Each formula above then holds for the dense part with Psi - Psi_e over N
plus the expert part with Psi_e/E_p over N/E_p (stage 3: 16 Psi_e/N); the table shows both
as columns (expert GB, dense GB). DeepSpeed's estimators have no expert term. Beside
--tensor-parallel the experts stay whole on each model-axis device (the dense part is split);
--sequence-parallel and --pipeline divide as without experts. No nvme rows with E_p > 1.
16-bit optimizer state, with --optimizer-dtype bf16 (bf16.bf16_optimizer_states: true): Adam's
moments rest in bfloat16 (2 bytes each), the master weights stay fp32, so K = 4 + 2 + 2 = 8
instead of 12: stage 0 12 Psi, stage 1 4 Psi + 8 Psi/N, stage 2 2 Psi + 10 Psi/N, stage 3
12 Psi/N; the offloaded host rows' 16 and 18 (4 + K and 6 + K) become 12 and 14, max(4 N, 16)
becomes max(4 N, 12), and the nvme rows count 8 bytes of masters and moments.
bf16 master weights, with --master-dtype bf16 (bf16.bf16_master_weights_and_grads: true): the
bf16 params are the masters, no fp32 copy, so K drops by 4: K = 8 with fp32 moments, K = 4
with --optimizer-dtype bf16 too (stage 0 8 Psi, stage 1 4 Psi + 4 Psi/N, stage 2 2 Psi +
6 Psi/N, stage 3 8 Psi/N), in the offloaded host rows as well; no nvme rows (jzero refuses the
NVMe tier with bf16 masters).
Long sequences: with the shape, a second table adds one long-context technique a row and
prints activations per device without and with AC (and the total with --stage's model states,
stage 3 by default): plain attention (the [s, s] scores kept); + blockwise attention (none; a
float32 log-sum-exp a head and token); + tiled loss and MLP (one --loss-chunk of the float32
[s, V] logits, --vocab V, and one --mlp-chunk of the [s, 4h] intermediate; 1024 tokens where
not given); + ring attention over --context-parallel C (every term's tokens / C); + activation
offload (cpu_checkpointing: AC's layer inputs in host memory, one on the device). With
--device-memory each row's longest sequence that fits (a multiple of S, x 2C with the ring),
found by bisection: the next step does not fit. --dropout off drops the masks (2*s*b*h and,
with plain attention, a*s^2*b bytes and the dropped-out probabilities); --attention,
--loss-chunk, --mlp-chunk, --activation-offload, --vocab and --context-parallel describe the
model of the first table too."""

_PLAN_HELP = """\
Every ZeRO stage of a config's built-in GPT side by side: per-device bytes of params,
gradients and optimizer state (device and host) from the plan, the largest layer stage 3
gathers at once, and the compiled step's memory_analysis() (arguments, temporaries, peak).
Activation checkpointing: each stage is compiled with the config's activation_checkpointing
(temp, peak) and with the opposite setting (no section or policy none: policy full; any other
policy: none), shown as temp/peak AC (or no AC). Without --device-memory the opposite is
compiled for every stage (twice the compilations; --compare-ac never skips it); with it, only
where it can change the advice (a stage that does not fit without AC, or fits with it).
With --device-memory: the levers in the order of their cost: the lowest stage whose peak fits
without activation checkpointing, keeping --margin free; then activation checkpointing (about
one extra forward pass per step); then offload. The advice names the lever that made it fit
and how much each option that does not fit is short."""


def _estimate(args: argparse.Namespace) -> int:
    from jzero import memory

    if args.experts is not None and args.expert_params is None:
        raise ValueError(
            f"--experts {args.experts} needs --expert-params, the parameters of all the experts "
            "together (part of --params), e.g. --expert-params 6e9: they are sharded apart from "
            "the dense parameters. Pass --expert-params, or leave out --experts."
        )
    arch = costs.PRESETS[args.preset] if args.preset else None
    if arch is None and args.params is None:
        raise ValueError(
            "jzero estimate needs the parameter count: pass --params (e.g. --params 7.5e9) or "
            f"--preset, one of {', '.join(costs.PRESETS)}."
        )
    if arch is not None:  # the preset's shape, where a flag does not give it
        given = [("params", arch.params()), ("experts", arch.experts or None),
                 ("expert_params", arch.expert_params() or None)]  # fmt: skip
        if args.seq_len is not None:  # the shape, for the activations
            given += [("hidden", arch.hidden), ("layers", arch.layers), ("heads", arch.heads),
                      ("vocab", arch.vocab)]  # fmt: skip
        for flag, value in given:
            if getattr(args, flag) is None:
                setattr(args, flag, value)
    largest_layer, largest_module = _largest_layer(args, arch)
    techniques = costs.Techniques(
        args.attention,
        dropout=args.dropout == "on",
        loss_chunk=args.loss_chunk,
        mlp_chunk=args.mlp_chunk,
        offload=args.activation_offload,
    )
    model = costs.ModelShape(
        args.params,
        largest_layer_params=largest_layer,
        largest_module_params=largest_module,
        seq_len=args.seq_len,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        vocab=args.vocab,
        techniques=techniques,
        experts=args.experts or 0,
        expert_params=args.expert_params or 0,
    )
    layout = costs.ParallelDims(
        args.devices,
        args.devices_per_node,
        micro_batch=args.micro_batch,
        replica=args.replicas,
        model=args.tensor_parallel,
        seq=args.sequence_parallel,
        context=args.context_parallel,
        pipe=args.pipeline,
        expert=args.expert_parallel,
        micro_batches=args.micro_batches,
        schedule=args.pipeline_schedule,
        virtual=args.virtual_stages,
    )
    dtypes = costs.Dtypes(args.activation_dtype, args.optimizer_dtype, args.master_dtype)
    options = {"margin": args.margin, "dtypes": dtypes, "sub_group_size": args.sub_group_size}
    result = memory.estimate(model, layout, args.device_memory, args.offload, **options)
    if not result.counts_activations:
        return _print_report(result, args.plot)
    # The long-sequence table adds a stage's model states without offload: an estimate of the
    # offloaded options only (--offload cpu) lacks them.
    whole = result
    if args.offload == "cpu":
        whole = memory.estimate(model, layout, args.device_memory, **options)
    return _print_report(result, args.plot, whole.sequence_report(args.stage).table())


def _largest_layer(args: argparse.Namespace, arch: Any) -> tuple[Any, Any]:
    """The largest layer stage 3 gathers, and DeepSpeed's (its largest module): as given by
    --largest-layer-params, else from the preset's shape, else from --hidden (and --vocab) as
    a GPT's largest matrix (the MLP's ``h x 4h``, or the ``V x h`` embedding), else 0."""
    if args.largest_layer_params is not None:
        return args.largest_layer_params, None
    if arch is None and args.hidden is not None:
        h = int(float(args.hidden))
        vocab = int(float(args.vocab)) if args.vocab is not None else 0
        arch = costs.Architecture(h, 1, 1, 4 * h, vocab, mlp="gelu", norm="layernorm", bias="all")
    if arch is None:
        return 0, None
    return arch.largest_layer_params(), arch.largest_module_params()


def _plan(args: argparse.Namespace) -> int:
    devices.use_cpu_devices(args.cpu_devices)
    from jzero.demo import plan

    if args.auto:  # the parallel sizes "auto": the ranked candidates, each compiled
        print(plan.auto_layout_table(args.config, args.device_memory, overrides=args.set or ()))
        return 0
    extra = {}  # "auto" is the library's default, and is not passed
    if args.compare_ac != "auto":
        extra["compare_checkpointing"] = args.compare_ac == "always"
    if args.preset:  # the Llama-shaped model of a published shape, not the config's GPT
        from jzero import memory

        compare = extra.get("compare_checkpointing")
        result = plan.architecture_report(
            args.config,
            costs.PRESETS[args.preset],
            args.devices,
            args.device_memory,
            overrides=args.set or (),
            margin=args.margin,
            rows=memory.StageRows(compare_checkpointing=compare),
        )
        return _print_report(result, args.plot)
    result = plan.plan_report(
        args.config,
        devices=args.devices,
        device_memory=args.device_memory,
        overrides=args.set or (),
        margin=args.margin,
        **extra,
    )
    return _print_report(result, args.plot)


def _print_report(result: Any, plot: str | None, more: str | None = None) -> int:
    """Prints the report's table (and ``more`` after a blank line) and, with ``--plot``, draws
    its chart; exit status 0."""
    print(result.table())
    if more:
        print()
        print(more)
    if plot:
        result.plot(plot)
        print(f"wrote {plot}")
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device-memory",
        metavar="SIZE",
        help="memory of one device, e.g. 80GB (10^9 bytes), 80GiB (2^30) or 8e10",
    )
    p.add_argument(
        "--margin",
        type=float,
        default=0.1,
        help="fraction of device memory kept free when judging what fits (default 0.1)",
    )
    p.add_argument("--plot", metavar="FILE.png", help="also draw stacked bars into this PNG")
    logs.add_verbose_flag(p)


def add_commands(subparsers: Any) -> None:
    """Adds ``estimate`` and ``plan`` to the ``jzero`` subcommands.

    Args:
      subparsers: the object ``ArgumentParser.add_subparsers()`` returned.
    """
    fmt = argparse.RawDescriptionHelpFormatter
    est = subparsers.add_parser(
        "estimate",
        help="closed-form ZeRO memory per device for a parameter count",
        description=_ESTIMATE_HELP,
        formatter_class=fmt,
    )
    est.add_argument("--params", help="parameter count Psi, e.g. 7.5e9 (or --preset)")
    est.add_argument(
        "--preset",
        choices=list(costs.PRESETS),
        help="a published shape: its parameter count, largest layer and experts, and with "
        "--seq-len its hidden size, layers, heads and vocabulary (a flag given beside it wins)",
    )
    est.add_argument("--devices", required=True, help="data-parallel devices N, e.g. 64")
    est.add_argument(
        "--devices-per-node",
        help="devices per node (host memory is per node); default: largest divisor of N <= 8",
    )
    est.add_argument(
        "--replicas",
        default=1,
        help="hybrid sharding: replica groups R (e.g. one per node); state is sharded within "
        "each group of N/R devices and only gradient shards cross groups (default 1)",
    )
    est.add_argument(
        "--tensor-parallel",
        "--tp",
        default=1,
        help="AutoTP's model axis T (tensor_parallel.autotp_size): each device holds Psi/T, "
        "ZeRO-sharded over N/T (default 1)",
    )
    est.add_argument(
        "--sequence-parallel",
        "--sp",
        default=1,
        help="Ulysses's seq axis S (sequence_parallel_size): activations / S, ZeRO over it too "
        "(default 1)",
    )
    est.add_argument(
        "--context-parallel",
        "--cp",
        default=1,
        help="ring attention's context axis C (context_parallel_size): each device holds s/C "
        "tokens, no head limit; activations / C, ZeRO over it too (default 1)",
    )
    est.add_argument(
        "--pipeline",
        "--pp",
        default=1,
        help="pipeline stages P (pipeline.stages): each device holds Psi/P, ZeRO-sharded over "
        "its stage's N/P devices; a stage runs L/P layers (default 1)",
    )
    est.add_argument(
        "--micro-batches",
        default=None,
        help="micro-batches M a step (gradient_accumulation_steps) under --pipeline; default 2P",
    )
    est.add_argument(
        "--pipeline-schedule",
        choices=list(SCHEDULES),
        default="1f1b",
        help="1f1b (default): a stage keeps P micro-batches of activations; gpipe: all M; "
        "interleaved_1f1b: V chunks of layers per stage, the bubble V times smaller; "
        "zero_bubble: the backward split in two, the weight gradients filling the bubble",
    )
    est.add_argument(
        "--virtual-stages",
        type=int,
        default=None,
        metavar="V",
        help="chunks of layers per stage under --pipeline-schedule interleaved_1f1b (default 2)",
    )
    est.add_argument(
        "--experts",
        metavar="E",
        help="mixture of experts: the experts of each MoE layer (needs --expert-params; "
        "default: no experts)",
    )
    est.add_argument(
        "--expert-params",
        metavar="COUNT",
        help="parameters of all the experts together, part of --params, e.g. 6e9; sharded over "
        "their expert data-parallel group of N/E_p devices, the rest over all N",
    )
    est.add_argument(
        "--expert-parallel",
        "--ep",
        default=1,
        help="expert axis E_p (expert_parallel.autoep_size): each device holds E/E_p experts, "
        "their states ZeRO-sharded over N/E_p; divides N and E (default 1)",
    )
    est.add_argument(
        "--optimizer-dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="dtype of the optimizer state at rest: fp32 (default, K = 12 bytes a parameter) or "
        "bf16, as the config's bf16.bf16_optimizer_states: true (bf16 moments, fp32 masters, "
        "K = 8)",
    )
    est.add_argument(
        "--master-dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="dtype of the master weights: fp32 (default, a 4-byte copy counted in K) or bf16, "
        "as the config's bf16.bf16_master_weights_and_grads: true (the bf16 params are the "
        "masters: K drops by 4, to 8, or 4 with --optimizer-dtype bf16)",
    )
    est.add_argument(
        "--sub-group-size",
        type=float,
        default=1e9,
        help="elements of one group of the NVMe tier's update (DeepSpeed's sub_group_size, "
        "default 1e9); its host buffers hold 4 groups",
    )
    est.add_argument(
        "--offload",
        choices=["cpu", "none"],
        help="list only options with offload to host memory (cpu) or only without (none); "
        "default: both",
    )
    est.add_argument(
        "--largest-layer-params",
        metavar="COUNT",
        help="parameters of the largest layer, gathered whole at stage 3 (default: from "
        "--preset, else a GPT's largest matrix: h x 4h, or the --vocab x --hidden embedding; "
        "else 0)",
    )
    shape = [
        ("--seq-len", "sequence length s"),
        ("--micro-batch", "micro batch per device b"),
        ("--hidden", "hidden size h"),
        ("--layers", "transformer layers L"),
        ("--heads", "attention heads a"),
    ]
    for flag, what in shape:
        est.add_argument(
            flag, metavar="N", help=f"{what}, for the activation term (give all five or none)"
        )
    est.add_argument(
        "--vocab",
        metavar="V",
        help="vocabulary size V, for the float32 [s, V] logits the loss keeps (default: not "
        "counted)",
    )
    est.add_argument(
        "--attention",
        choices=list(costs.ATTENTIONS),
        default="blockwise",
        help="blockwise (default: flash-style, the attention jzero's built-in models run): no "
        "[s, s] scores kept; plain: the [s, s] scores a head are kept (Korthikanti et al.)",
    )
    est.add_argument(
        "--dropout",
        choices=["on", "off"],
        default="off",
        help="off (default: the built-in models have no dropout): no masks; on (Korthikanti et "
        "al.'s accounting): 1-byte dropout masks are kept",
    )
    est.add_argument(
        "--loss-chunk",
        type=int,
        default=0,
        metavar="TOKENS",
        help="tiled loss: the logits are never whole, one chunk of TOKENS is (the built-in "
        "GPT's loss_chunk); 0 (default): whole",
    )
    est.add_argument(
        "--mlp-chunk",
        type=int,
        default=0,
        metavar="TOKENS",
        help="tiled MLP: the [s, 4h] intermediate is recomputed in chunks of TOKENS (the "
        "built-in GPT's mlp_chunk); 0 (default): kept whole",
    )
    est.add_argument(
        "--activation-offload",
        action="store_true",
        help="activation_checkpointing.cpu_checkpointing: with activation checkpointing the "
        "layer inputs live in host memory (the device keeps the one in flight)",
    )
    est.add_argument(
        "--stage",
        type=int,
        choices=[0, 1, 2, 3],
        default=3,
        help="the ZeRO stage whose model states (without offload) the long-sequence table adds "
        "(default 3)",
    )
    est.add_argument(
        "--activation-dtype",
        choices=["bf16", "fp16", "fp32"],
        default="bf16",
        help="dtype of the activations (default bf16; fp32 doubles the 16-bit part)",
    )
    _common(est)
    est.set_defaults(func=_estimate)

    plan = subparsers.add_parser(
        "plan",
        help="measure every ZeRO stage of a config's GPT and recommend one",
        description=_PLAN_HELP,
        formatter_class=fmt,
    )
    plan.add_argument("config", help="a YAML or JSON config with a model section")
    plan.add_argument(
        "--devices",
        help="data-parallel devices to plan for (default: the config's mesh); more than this "
        "machine has: the compiled part is measured on the local devices",
    )
    plan.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set model.num_layers=24 (repeatable)",
    )
    plan.add_argument(
        "--preset",
        choices=[name for name, arch in costs.PRESETS.items() if not arch.experts],
        help="plan a Llama-shaped model of this published shape (RMSNorm, rotary, grouped-query "
        "attention, SwiGLU, untied head) instead of the config's GPT; the config gives "
        "model.seq_len, the batch and the precision (e.g. with --devices 64: the model state "
        "on an abstract mesh)",
    )
    devices.add_cpu_devices_flag(plan)
    plan.add_argument(
        "--compare-ac",
        choices=["auto", "always", "never"],
        default="auto",
        help="also compile each stage with the opposite activation-checkpointing setting: "
        "auto (default): every stage without --device-memory, with it only where it can "
        "change the advice; always; never",
    )
    plan.add_argument(
        "--auto",
        action="store_true",
        help='rank the layouts of the parallel sizes written "auto" (tensor, sequence, '
        "pipeline, expert, accumulation) by predicted step time and compile each: layout, "
        "stage, predicted time, bytes per axis, compiled need, whether it fits; trains nothing",
    )
    _common(plan)
    plan.set_defaults(func=_plan)
