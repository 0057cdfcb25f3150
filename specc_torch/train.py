"""Training a spec: `launch` (what `specc train` runs: check everything, then start the ranks
through torchrun, or run in this process for one rank), `run` (one rank, under torchrun or
alone) and `rank_main`, the entry of the ranks `launch` starts. Ranks launched by hand (`torchrun
-m specc_cli.rank SPEC [flags]`) parse their flags in the command line's layer and call `run`.
The spec is compiled (train_compile.py) and the run checked (train_checks.py) before it is handed
to the loop (runtime.train), which knows nothing of the compiler."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

from runtime.compile import repeated_layers
from runtime.data import DataError, build_datasets, parse_blend
from runtime.train.config import TrainConfig, split_weights

from .megatron_ckpt.train import is_foreign_megatron_dir, megatron_import, megatron_save
from .torchrun import report_error
from .train_checks import (
    DEFAULT_DATA,
    check,
    claim_save_dir,
    default_data,
    has_data,
    save_dir_rules,
    split_paths,
    starts_fresh,
)
from .train_compile import RUN_FILES, ConfigError, compile_run, config_from_dict, error_lines, write_run_files

# -- launcher ----------------------------------------------------------------------------------------

@dataclass
class Launch:
    """torchrun's options for `launch` (its flags of the same names)."""

    nproc_per_node: int = 1
    nnodes: int = 1
    max_restarts: int = 0
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_backend: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None


def launch(cfg: TrainConfig, args: Launch) -> int:
    """Check everything, then start the ranks through torchrun (or train in this process: one
    rank, nothing to restart)."""
    from specc.errors import SpecError

    try:
        if args.nproc_per_node < 1 or args.nnodes < 1:
            raise ConfigError([f"--nproc-per-node and --nnodes must be at least 1, got {args.nproc_per_node}, "
                               f"{args.nnodes}"])
        if args.max_restarts < 0:
            raise ConfigError([f"--max-restarts must be at least 0, got {args.max_restarts}"])
        launch_errors = _launch_rules(args, cfg.device)
        if launch_errors:
            raise ConfigError(launch_errors)
        world = args.nproc_per_node * args.nnodes
        check(cfg, world)
        if not has_data(cfg):
            cfg.data.data_path = default_data(cfg.logging.run_dir, log=lambda m: print(m, file=sys.stderr))
            check(cfg, world)
        fit_errors = fit_rules(cfg, args.nproc_per_node)
        if fit_errors:
            raise ConfigError(fit_errors)
        if args.nnodes == 1 or args.node_rank == 0:  # (another node's launcher may start after rank 0 took it)
            save_errors = save_dir_rules(cfg)
            if save_errors:
                raise ConfigError(save_errors)
    except (ConfigError, SpecError, DataError) as e:
        for line in error_lines(e):
            print(line, file=sys.stderr)
        return 2
    if world == 1 and args.max_restarts == 0:
        return run(cfg)  # nothing to restart: this process is the rank
    # Every rank re-checks; derived values (DP, global batch) are derived again from the world.
    cfg.parallel.dp = 1
    payload = json.dumps(cfg.to_dict())
    # torchrun, with a rank's one-line error printed once and exit code 2 (specc_torch/torchrun.py)
    cmd = [sys.executable, "-m", "specc_torch.torchrun", "--nproc-per-node", str(args.nproc_per_node),
           "--nnodes", str(args.nnodes)]
    if args.max_restarts:
        cmd += ["--max-restarts", str(args.max_restarts)]
    passthrough = {"node_rank": "--node-rank", "master_addr": "--master-addr", "master_port": "--master-port",
                   "rdzv_backend": "--rdzv-backend", "rdzv_endpoint": "--rdzv-endpoint", "rdzv_id": "--rdzv-id"}
    given = {flag: getattr(args, name) for name, flag in passthrough.items() if getattr(args, name) is not None}
    if args.nnodes == 1 and not given:
        cmd.append("--standalone")  # a free local port, no rendezvous setup
    for flag, value in given.items():
        cmd += [flag, str(value)]
    cmd += ["-m", "specc_torch.train", cfg.spec, "--config-json", payload]
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc_per_node)))
    restarts = f" --max-restarts {args.max_restarts}" if args.max_restarts else ""
    print(f"launching {world} rank{'s' if world > 1 else ''}: torchrun --nproc-per-node {args.nproc_per_node} "
          f"--nnodes {args.nnodes}{restarts} -m specc_torch.train {cfg.spec} ...", file=sys.stderr, flush=True)
    try:
        return subprocess.call(cmd, env=env)
    except KeyboardInterrupt:
        return 130


def fit_rules(cfg: TrainConfig, ranks_per_node: int) -> list:
    """The plan's memory per rank against this node's (specc_torch.memory_check): one line when
    it cannot fit, before any rank allocates anything."""
    import torch

    from specc_torch.memory_check import memory_rules

    _, _, plan = compile_run(cfg)
    device = "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"
    return memory_rules(plan.totals, cfg, ranks_per_node, device)


def _launch_rules(args: Launch, device: str) -> list:
    """torchrun's flags, checked here rather than in torchrun's traceback."""
    errors = []
    if args.master_port is not None and not 1 <= args.master_port <= 65535:
        errors.append(f"--master-port {args.master_port}: a port is between 1 and 65535")
    if args.rdzv_endpoint is not None:
        host, sep, port = args.rdzv_endpoint.rpartition(":")
        if sep and (not port.isdigit() or not 1 <= int(port) <= 65535):
            errors.append(f"--rdzv-endpoint {args.rdzv_endpoint}: expected HOST:PORT with a port between 1 and 65535")
    if args.node_rank is not None and not 0 <= args.node_rank < args.nnodes:
        errors.append(f"--node-rank {args.node_rank}: must be between 0 and --nnodes - 1 ({args.nnodes - 1})")
    import torch

    if device in ("cuda", "auto") and torch.cuda.is_available() and \
            args.nproc_per_node > torch.cuda.device_count():
        errors.append(f"--nproc-per-node {args.nproc_per_node}: this node has {torch.cuda.device_count()} GPU(s), "
                      f"one per rank (use --device cpu for more ranks than GPUs)")
    return errors


# -- one rank ------------------------------------------------------------------------------------------

def rank_main(argv=None) -> int:
    """`python -m specc_cli.rank SPEC --config-json JSON`: one rank that `launch` started through
    torchrun, with the configuration it checked. Ranks launched by hand with Megatron's flags run
    `torchrun -m specc_cli.rank SPEC [flags]` (the command line's layer parses them)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 3 or argv[1] != "--config-json":
        print("python -m specc_torch.train: takes SPEC --config-json JSON from `specc train`; to launch ranks "
              "yourself with training flags run `torchrun ... -m specc_cli.rank SPEC [flags]`", file=sys.stderr)
        return 2
    return run(config_from_dict(json.loads(argv[2])))


def run(cfg: TrainConfig, stream=None) -> int:
    """Train on this rank. WORLD_SIZE/RANK/LOCAL_RANK come from torchrun (absent: one rank)."""
    import torch
    import torch.distributed as dist

    from runtime.checkpoint import (
        CheckpointError,
        adam_state,
        latest_step,
        load_checkpoint,
        read_info,
        restore_adam,
        save_checkpoint,
    )
    from runtime.checkpoint import resolve as checkpoint_path
    from runtime.cpu.host_memory import retain_freed_memory
    from runtime.cpu.shared_memory import TransportError
    from runtime.parallel_state import ProcessGroups
    from runtime.train.report import NullReporter, Reporter
    from runtime.train.throughput import given_peak, measure_peak
    from runtime.train.training import (
        TrainState,
        reload_master_weights,
        resolve_device,
        setup_model_and_optimizer,
        train,
    )
    from specc.errors import SpecError

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # torchrun's elastic attempt

    def fail(e) -> int:
        lines = error_lines(e)
        # under `specc train`, the launcher prints the first rank's lines once (specc_torch/torchrun.py)
        if not report_error(lines, rank) and rank == 0:
            for line in lines:
                print(line, file=sys.stderr, flush=True)
        return 2

    try:
        check(cfg, world)
    except (ConfigError, SpecError, DataError) as e:
        return fail(e)
    device = resolve_device(cfg.device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    host_memory = "host memory: glibc's defaults (--host-memory release)"
    if device.type == "cpu" and cfg.host_memory == "retain":  # before the model's memory is allocated
        host_memory = retain_freed_memory()
    initialized_here = False
    if world > 1 and not dist.is_initialized():
        init_process_group("nccl" if device.type == "cuda" else "gloo", cfg.distributed_timeout_minutes)
        initialized_here = True
    # --save is this run's alone: rank 0 holds its lock until the run ends (claim_save_dir)
    lock, error, own = claim_save_dir(cfg, rank, world, restart)

    def stop(e) -> int:  # before the run's try/finally: give back what is held so far
        if lock is not None:
            lock.release()
        if initialized_here:
            dist.destroy_process_group()
        return fail(e)

    if error is not None:
        return stop(ConfigError([error]))
    # What to load: --load, or on an elastic restart the newest checkpoint this run saved; a
    # checkpoint without optimizer and data state (`specc hf import`) gives the weights only.
    load, weights_only, skip_optimizer = cfg.checkpoint.load, False, False
    given = cfg.checkpoint.load  # what --load names (a Megatron checkpoint: its conversion)
    fresh = starts_fresh(cfg)  # --save X --load X, nothing in X yet
    if fresh:
        load = None
    try:
        if own and latest_step(cfg.checkpoint.save) is not None:
            load = cfg.checkpoint.save
        elif load and is_foreign_megatron_dir(load):  # converted as --finetune / --no-load-optim say
            load = given = megatron_import(cfg, local_rank, world)  # (megatron_load_rules)
        if load:
            info = read_info(checkpoint_path(load))
            skip_optimizer = cfg.checkpoint.no_load_optim and load == given
            weights_only = (info.get("optimizer") is None and not skip_optimizer) or not info.get("data")
            # --finetune: the weights only; --no-load-optim: also the iteration and data position
            weights_only = weights_only or (cfg.checkpoint.finetune and load == given)
    except CheckpointError as e:
        return stop(e)
    try:
        pg = ProcessGroups.initialize(tp=cfg.parallel.tp, cp=cfg.parallel.cp, pp=cfg.parallel.pp, ep=cfg.parallel.ep,
                                      transport=cfg.parallel.transport,
                                      timeout_minutes=cfg.distributed_timeout_minutes) \
            if world > 1 \
            else ProcessGroups.single()
    except TransportError as e:  # --collective-transport shm where it cannot be used
        return stop(ConfigError([f"--collective-transport shm: {e}"]))
    reporter = NullReporter()
    try:
        if not has_data(cfg):  # launched by hand without --data-path: one preparer per node
            path = os.path.join(cfg.logging.run_dir, DEFAULT_DATA)
            if local_rank == 0:
                default_data(cfg.logging.run_dir, log=lambda m: print(m, file=sys.stderr) if rank == 0 else None)
            if world > 1:
                dist.barrier()
            cfg.data.data_path = path
            try:
                check(cfg, world)
            except (ConfigError, SpecError, DataError) as e:
                return fail(e)
        source, spec, plan = compile_run(cfg)
        model_file = os.path.join(cfg.logging.run_dir, RUN_FILES[0])
        if local_rank == 0:  # one writer per node (the same bytes: a shared run directory is fine)
            write_run_files(cfg.logging.run_dir, source, plan)
        if world > 1:
            dist.barrier()
        setup = setup_model_and_optimizer(cfg, pg, device, compiled=(source, spec), model_file=model_file)
        seq = setup.spec.config["seq_length"]
        datasets = build_datasets(cfg.data.data_path, seq, cfg.seed, split_weights(cfg.data.split),
                                  mock=cfg.data.mock_data, vocab_size=setup.spec.config["vocab_size"],
                                  split_paths=split_paths(cfg))
        append = bool(load and not weights_only) or restart > 0
        dtype = torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else torch.float32
        peak = given_peak(cfg.logging.peak_tflops) if cfg.logging.peak_tflops else measure_peak(device, dtype)
        if rank == 0:  # a resumed run (or a restarted one) appends to its metrics; a new one starts afresh
            log = cfg.logging
            reporter = Reporter(log.run_dir, cfg.train_iters, log.log_interval, progress=log.progress, stream=stream,
                                append=append, tensorboard_dir=log.tensorboard_dir, peak=peak,
                                wandb_project=log.wandb_project, wandb_exp_name=log.wandb_exp_name,
                                tensorboard=log, world_size=world)
        flops_per_iteration = rank_flops(plan.totals, pg.pp.rank) * cfg.num_micro_batches
        stages = f", pipeline rank {pg.pp.rank}'s stages" if pg.pp.size > 1 else ""
        reporter.info(f"peak {peak.tflops:.3f} TFLOP/s per rank, {peak.source}; a step's FLOPs per rank "
                      f"{flops_per_iteration:,} (the compiled plan's matrix multiplies{stages}, "
                      f"{cfg.num_micro_batches} micro-batch{'es' if cfg.num_micro_batches > 1 else ''}); "
                      f"MFU = achieved TFLOP/s / peak")
        reporter.start(cfg.to_dict(), setup.spec.config)
        for note in cfg.notes:  # where Megatron warns and carries on
            reporter.info(f"note: {note}")
        _report_setup(reporter, cfg, setup, pg, datasets)
        if device.type == "cpu":
            reporter.info(host_memory)
        reporter.info(f"run directory {cfg.logging.run_dir}: {', '.join(RUN_FILES)} (the model is imported from "
                      f"its model.py), config.json, metrics.jsonl; TensorBoard in "
                      f"{cfg.logging.tensorboard_dir or os.path.join(cfg.logging.run_dir, 'tensorboard')}")
        if restart > 0:
            reporter.info(f"elastic restart {restart}: "
                          + (f"resuming from {load}" if load else "no checkpoint to resume from, starting over"))
        if lock is not None and lock.note:
            reporter.info(lock.note)
        if fresh:
            reporter.info(f"--load {cfg.checkpoint.load}: no checkpoint there yet (it is the --save directory too): "
                          f"training starts from scratch")
        if load and given != cfg.checkpoint.load:  # a Megatron checkpoint (megatron_import)
            what = ("its weights" if weights_only else "its weights, iteration and data position"
                    + ("" if skip_optimizer else " and optimizer state"))
            reporter.info(f"--load {cfg.checkpoint.load}: a Megatron Core checkpoint, converted through the spec's "
                          f"megatron.checkpoint names into {load}: {what} load")
        state = TrainState()
        if load and weights_only:  # the model's weights only: iteration 0, a fresh optimizer
            try:
                out = load_checkpoint(load, setup.model, pg, allow_spec_change=cfg.checkpoint.allow_spec_change)
            except CheckpointError as e:
                return fail(e)
            reload_master_weights(setup.optimizer)
            why = "--finetune" if cfg.checkpoint.finetune else "no optimizer or data state in it"
            reporter.info(f"loaded model weights from {out['path']} ({why}): "
                          f"training starts at iteration 0 with a fresh optimizer"
                          + (f" (saved at {out['saved_layout']}, resharded)" if out["resharded"] else ""))
        elif load and skip_optimizer:  # --no-load-optim: weights, iteration, data position; a fresh optimizer
            try:
                out = load_checkpoint(load, setup.model, pg, allow_spec_change=cfg.checkpoint.allow_spec_change,
                                      rng_tracker=setup.rng_tracker)
            except CheckpointError as e:
                return fail(e)
            reload_master_weights(setup.optimizer)
            state.iteration = int(out["step"])
            state.consumed_samples = int(out["data_state"]["consumed_samples"])
            reporter.info(f"loaded checkpoint {out['path']} at iteration {state.iteration} without its optimizer "
                          f"state (--no-load-optim): a fresh optimizer"
                          + (f" (saved at {out['saved_layout']}, resharded)" if out["resharded"] else ""))
        elif load:  # any TP x DP layout: runtime.checkpoint reshards
            try:
                out = load_checkpoint(load, setup.model, pg, allow_spec_change=cfg.checkpoint.allow_spec_change,
                                      optimizer_state=adam_state(setup.optimizer, setup.model),
                                      rng_tracker=setup.rng_tracker)
            except CheckpointError as e:
                return fail(e)
            restore_adam(setup.optimizer, out["optimizer_state"])
            state.iteration = int(out["step"])
            state.consumed_samples = int(out["data_state"]["consumed_samples"])
            reporter.info(f"loaded checkpoint {out['path']} at iteration {state.iteration}"
                          + (f" (saved at {out['saved_layout']}, resharded)" if out["resharded"] else ""))
        if load and not weights_only and out["resharded"] and read_info(out["path"]).get("rng"):
            reporter.info("note: the checkpoint's RNG states are not restored at another layout (each rank's belong "
                          "to a rank of the layout that saved, as Megatron's 'RNG state will be ignored'): dropout "
                          "draws from streams seeded afresh, so this run does not continue the saved one bit for bit")
        if load and not weights_only:  # the schedule's iteration is the checkpoint's step (checkpoints before
            scheduled = (out["scheduler_state"] or {}).get("iteration")  # the step was in the data: the only check)
            if scheduled is not None and scheduled != state.iteration:
                return fail(CheckpointError(f"{out['path']}: its scheduler state is at iteration {scheduled}, but "
                                            f"the checkpoint is step {state.iteration} (an edited checkpoint.json?)"))
        if append:  # the iterations after the one resumed from are recorded again: drop their old lines
            reporter.resume(state.iteration, state.consumed_samples)

        def save(st):
            setup.ddp.finish_param_sync()  # --overlap-param-gather: the gathered parameters are saved
            reporter.sync()  # the metrics up to this checkpoint survive whatever happens after it
            path = save_checkpoint(cfg.checkpoint.save, st.iteration, setup.model, pg,
                                   optimizer_state=adam_state(setup.optimizer, setup.model),
                                   scheduler_state={"iteration": st.iteration},
                                   data_state={"consumed_samples": st.consumed_samples},
                                   rng_tracker=setup.rng_tracker, config=cfg.to_dict(),
                                   keep_last=cfg.checkpoint.keep_last)
            reporter.info(f"saved checkpoint {path}")
            if cfg.checkpoint.ckpt_format:  # Megatron's too, beside it (specc_torch/megatron_ckpt/train.py)
                reporter.info(f"saved Megatron's {cfg.checkpoint.ckpt_format} checkpoint "
                              f"{megatron_save(cfg, st.iteration, rank, world)}")

        try:  # a save that fails (a full disk) is one line on every rank, and the run stops
            losses = train(setup, datasets, cfg, pg, reporter, state, save_fn=save if cfg.checkpoint.save else None,
                           before_step=_test_kill_hook(rank, world, restart), flops_per_iteration=flops_per_iteration,
                           after_first_step=lambda measured: reporter.info(memory_report(plan.totals, measured, cfg,
                                                                                         pg, setup.device)))
            if cfg.checkpoint.save and not (cfg.checkpoint.save_interval and
                                            state.iteration % cfg.checkpoint.save_interval == 0):
                save(state)
        except CheckpointError as e:
            return fail(e)
        if losses:
            reporter.info(f"done: {len(losses)} iterations, loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
                          f"metrics in {cfg.logging.run_dir}")
        return 0
    finally:
        reporter.close()
        pg.destroy()
        if initialized_here:
            dist.destroy_process_group()
        if lock is not None:
            lock.release()


def init_process_group(backend: str, timeout_minutes: float | None = None) -> None:
    """torch.distributed's env:// initialization (torchrun's MASTER_ADDR/PORT, RANK, WORLD_SIZE),
    with the store keys of each elastic attempt under their own prefix. torchrun keeps one store
    for all attempts (the agent's); without the prefix, the ranks of a restart would read the gloo
    addresses that the dead ranks of the attempt before published, and fail to connect.
    timeout_minutes: Megatron's --distributed-timeout-minutes (None: torch's default, 30)."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    timeout = datetime.timedelta(minutes=timeout_minutes) if timeout_minutes is not None else default_pg_timeout
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:  # not under torchrun: nothing is restarted
        dist.init_process_group(backend, **({"timeout": timeout} if timeout_minutes is not None else {}))
        return
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    dist.init_process_group(backend, store=dist.PrefixStore(f"specc/attempt_{attempt}", store), rank=rank,
                            world_size=world_size, timeout=timeout)


KILL_AT_ITER = "SPECC_TEST_KILL_AT_ITER"
KILL_RANK = "SPECC_TEST_KILL_RANK"


def _test_kill_hook(rank: int, world: int, restart: int):
    """A test-only fault: with SPECC_TEST_KILL_AT_ITER=N in the environment, the last rank (or
    rank SPECC_TEST_KILL_RANK) SIGKILLs itself just before iteration N, on the first attempt only
    (TORCHELASTIC_RESTART_COUNT 0 or unset), so tests can check that `--max-restarts` resumes from
    the last checkpoint. Unset (always, outside tests), it does nothing."""
    value = os.environ.get(KILL_AT_ITER)
    if not value or restart > 0 or rank != int(os.environ.get(KILL_RANK, world - 1)):
        return None
    kill_at = int(value)

    def before_step(iteration: int) -> None:
        if iteration == kill_at:
            import signal

            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    return before_step


def _fp16_text(cfg: TrainConfig) -> str:
    ls = cfg.loss_scale
    if ls.loss_scale is not None:
        return f"fp16 autocast, loss scale {ls.loss_scale:g}, "
    return (f"fp16 autocast, dynamic loss scale from {ls.initial_loss_scale:g} (min {ls.min_loss_scale:g}, "
            f"window {ls.loss_scale_window}, hysteresis {ls.hysteresis}), ")


def rank_flops(totals: dict, pp_rank: int = 0) -> int:
    """One micro-batch's forward + backward FLOPs on a rank (the plan's): at PP its own stages'
    (each pipeline rank runs only its layers), else the whole model's. An expert-parallel rank's
    experts compute its own tokens' rows on average: the plan counts those already."""
    if "pipeline" in totals:
        return sum(st["flops"] for st in totals["pipeline"]["stages"] if st["rank"] == pp_rank)
    return totals["flops_per_step"]


def memory_report(totals: dict, measured: dict, cfg: TrainConfig, pg, device) -> str:
    """The plan's memory per rank next to what the first step measured, by what holds it."""
    from runtime.train.training import max_memory_mb
    from specc.plan.render import human_bytes
    from specc_torch.memory_check import rank_need

    # this rank's share: its pipeline stages, its experts, its optimizer shard
    planned = rank_need(totals, cfg, pg.pp.rank, in_flight=False)
    rows = " | ".join(f"{name} {human_bytes(planned[name])} / {human_bytes(measured[name])}" for name in planned)
    peak = ("peak allocated" if device.type == "cuda" else "peak resident set (the whole process, torch included)")
    dp, ep = pg.dp.size, pg.ep.size
    over = ""
    if cfg.optimizer.use_distributed_optimizer and dp > 1:
        over = f", over DP={dp}" + (f" (experts' over DP/EP={dp // ep})" if ep > 1 else "")
    stages = f", pipeline rank {pg.pp.rank}'s stages" if pg.pp.size > 1 else ""
    return (f"memory per rank, plan / measured after the first step: {rows} (activations: one micro-batch"
            f"{' of each stage' if pg.pp.size > 1 else ''}, measured as the unique storages autograd saved for "
            f"backward; optimizer: Adam moments{' and fp32 masters' if cfg.bf16 else ''}{over}{stages}); "
            f"{peak} {max_memory_mb(device):.1f} MiB")


def _report_setup(reporter, cfg: TrainConfig, setup, pg, datasets) -> None:
    opt = setup.optimizer
    params = sum(p.numel() for p in setup.model.parameters())
    reporter.info(f"world {pg.world_size} = TP {pg.tp.size} x CP {pg.cp.size} x DP {pg.dp.size} x PP {pg.pp.size}; "
                  f"global batch {cfg.global_batch_size} = micro batch {cfg.micro_batch_size} x DP {pg.dp.size} x "
                  f"{cfg.num_micro_batches} accumulation steps; device {setup.device}")
    if pg.world_size > 1 and setup.device.type == "cpu":
        reporter.info(pg.transport_summary())
    reporter.info(f"parameters on this rank: {params:,} ({setup.ddp.param_dtype}); gradient buckets: "
                  f"{len(setup.ddp.buckets)}; {'bf16 autocast, ' if cfg.bf16 else ''}"
                  f"{_fp16_text(cfg) if cfg.fp16 else ''}fp32 gradients and master weights; optimizer "
                  f"{cfg.optimizer.optimizer}")
    if cfg.torch_compile:
        reporter.info(f"torch.compile (backend {cfg.torch_compile}): each of the {len(repeated_layers(setup.model))} "
                      f"repeated layers compiled on its own, the rest eager; the first steps include compilation")
    measured, replicated = opt.state_bytes(), opt.replicated_state_bytes()
    kind = f"distributed over DP={pg.dp.size}" if opt.distributed else "replicated"
    reporter.info(f"optimizer state per rank (measured): {measured / 2**20:.3f} MiB, {kind}; a replicated optimizer "
                  f"holds {replicated / 2**20:.3f} MiB (ratio {measured / replicated:.3f}, 1/DP = {1 / pg.dp.size:.3f})")
    def blend(path) -> str:
        return " ".join((f"{w:g} {p}" if w is not None else p) for w, p in parse_blend(path))

    per_split = split_paths(cfg)
    source = "mock data (seeded random tokens)" if cfg.data.mock_data else blend(cfg.data.data_path) \
        if per_split is None else "; ".join(f"{name} {blend(p)}" for name, p in per_split.items() if p is not None)
    vocab = setup.spec.config["vocab_size"]
    padded = (f"; vocabulary {vocab} ({cfg.data.tokenizer_type}, padded to a multiple of "
              f"{cfg.data.make_vocab_size_divisible_by} x TP {cfg.parallel.tp})") if cfg.data.padded_vocab_size else ""
    reporter.info(f"data {source}: {len(datasets['train']):,} train and {len(datasets['valid']):,} validation samples "
                  f"per epoch of {datasets['train'].seq_length} tokens{padded}")


if __name__ == "__main__":
    sys.exit(rank_main())
