"""Training a spec: `launch` (what `specc train` runs: check everything, then start the ranks
through torchrun, or run in this process for one rank), `run` (one rank, under torchrun or
alone) and `rank_main`, the entry of the ranks `launch` starts. Ranks launched by hand (`torchrun
-m specc_cli.rank SPEC [flags]`) parse their flags in the command line's layer and call `run`.
Here the spec is compiled (compile_model) and handed to the loop (runtime.train), which knows
nothing of the compiler."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

from runtime.compile import repeated_layers
from runtime.data import (
    DataError,
    build_datasets,
    build_tokenizer,
    open_corpora,
    parse_blend,
    prepare,
    read_sidecar,
    split_documents,
    stdlib_files,
    vocab_size_with_padding,
)
from runtime.train.config import (
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    LossScaleConfig,
    OptimizerConfig,
    ParallelConfig,
    ScheduleConfig,
    TrainConfig,
    _note,
    model_rules,
    resolve,
    split_weights,
)
from specc.settings import Settings

from .api import compile_source
from .megatron_ckpt.train import (
    ckpt_format_rules,
    is_foreign_megatron_dir,
    megatron_import,
    megatron_load_rules,
    megatron_save,
)
from .torchrun import report_error


class ConfigError(Exception):
    """Broken rules, one line each."""

    def __init__(self, lines: list):
        super().__init__("\n".join(lines))
        self.lines = lines


# -- configuration from the command line -----------------------------------------------------------

def config_from_dict(d: dict) -> TrainConfig:
    d = dict(d)
    sections = {"parallel": ParallelConfig, "optimizer": OptimizerConfig, "schedule": ScheduleConfig,
                "data": DataConfig, "checkpoint": CheckpointConfig, "logging": LoggingConfig,
                "loss_scale": LossScaleConfig}
    for name, cls in sections.items():
        d[name] = cls(**d[name])
    return TrainConfig(**d)


def spec_stem(path: str) -> str:
    base = os.path.basename(os.path.normpath(path))
    return base.rsplit(".", 1)[0] if base.endswith((".yaml", ".yml")) else base


# -- the model: the spec compiled at the configured settings ------------------------------------------

def compile_model(cfg: TrainConfig):
    """(generated source, spec) for the configured spec at the configured parallel settings: what
    runtime.train.setup_model_and_optimizer builds the model from."""
    source, spec, _ = _compile(cfg)
    return source, spec


def _compile(cfg: TrainConfig):
    overrides = dict(cfg.overrides)
    if cfg.data.padded_vocab_size is not None and "vocab_size" not in overrides:
        overrides["vocab_size"] = cfg.data.padded_vocab_size  # the tokenizer's, padded (tokenizer_rules)
    return compile_source(cfg.spec, compile_settings(cfg), overrides)


def compile_settings(cfg: TrainConfig) -> Settings:
    """The compiler's settings of a training configuration: the runtime's ParallelConfig holds
    every parallel setting under the same name (tests/specc_cli/test_settings_table.py checks it)."""
    return Settings(**{name: getattr(cfg.parallel, name) for name in Settings.names("parallel")},
                    micro_batch_size=cfg.micro_batch_size, dtype="bf16" if cfg.bf16 else "fp16" if cfg.fp16 else "fp32",
                    reset_position_ids=cfg.data.reset_position_ids, reset_attention_mask=cfg.data.reset_attention_mask,
                    **cfg.recompute)


RUN_FILES = ("model.py", "plan.txt", "plan.json")


def compile_run(cfg: TrainConfig):
    """(generated source, spec, plan) for the configured spec and settings: the model and the
    plan that trains, as compile_model, plus the plan (specc.plan.Plan) of the same graph."""
    from specc.plan import build_plan

    source, spec, graph = _compile(cfg)
    return source, spec, build_plan(graph)


def write_run_files(run_dir: str, source: str, plan) -> str:
    """RUN_DIR/model.py, plan.txt and plan.json: exactly what trains (each written atomically; a
    resumed run writes what it trains now). Returns model.py's path."""
    from specc.files import atomic_write_text
    from specc.plan import plan_json, plan_text

    os.makedirs(run_dir, exist_ok=True)
    for name, text in zip(RUN_FILES, (source, plan_text(plan), plan_json(plan))):
        atomic_write_text(os.path.join(run_dir, name), text)
    return os.path.join(run_dir, RUN_FILES[0])


# -- checks shared by the launcher and every rank ----------------------------------------------------

def check(cfg: TrainConfig, world_size: int):
    """Resolve and check the configuration; returns the compiled spec. Raises ConfigError (every
    broken rule), SpecError (the spec or an override) or DataError (the data)."""
    errors = resolve(cfg, world_size)
    if errors:
        raise ConfigError(errors)
    if not os.path.isfile(cfg.spec):
        raise ConfigError([f"{cfg.spec}: no such spec file"])
    errors = tokenizer_rules(cfg)
    errors += eod_rules(cfg)
    errors += packed_rules(cfg)
    if errors:
        raise ConfigError(errors)
    _, spec = compile_model(cfg)
    errors = model_rules(cfg, spec.config)
    if has_data(cfg) and not errors:
        errors += data_rules(cfg, spec.config)
    if cfg.checkpoint.load is not None and starts_fresh(cfg):
        pass  # --save X --load X with nothing saved in X yet: the first launch starts afresh, as in Megatron
    elif cfg.checkpoint.load is not None and not os.path.isdir(cfg.checkpoint.load):
        errors.append(f"--load {cfg.checkpoint.load}: no such directory")
    elif cfg.checkpoint.load is not None and is_foreign_megatron_dir(cfg.checkpoint.load):
        errors += megatron_load_rules(cfg)
    elif cfg.checkpoint.load is not None:
        errors += _checkpoint_rules(cfg.checkpoint.load)
    errors += _no_load_rng_rules(cfg)
    errors += ckpt_format_rules(cfg)
    errors += output_rules(cfg)
    if cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            errors.append(f"--device cuda: CUDA is not available here (torch {torch.__version__}"
                          + (", built without CUDA" if torch.version.cuda is None else ", no GPU found")
                          + "); use --device cpu or auto")
    if errors:
        raise ConfigError(errors)
    return spec


def _no_load_rng_rules(cfg: TrainConfig) -> list:
    """Megatron's --no-load-rng: a checkpoint that loads restores its RNG states here, so with one
    in --load it is refused; with none there yet it changes nothing, and the log says so."""
    load = cfg.checkpoint.load
    if not cfg.checkpoint.no_load_rng or load is None:
        return []
    if any(os.path.isfile(os.path.join(load, name)) for name in ("latest", "checkpoint.json")):
        return [f"--no-load-rng: --load {load} holds a checkpoint, and loading restores its RNG states; loading "
                "without them is not implemented (drop --no-load-rng)"]
    _note(cfg, f"--no-load-rng: no effect (no checkpoint in --load {load} yet)")
    return []


def output_rules(cfg: TrainConfig) -> list:
    """--save, --run-dir and --tensorboard-dir name folders: each must be one, or be creatable; the
    files a run writes in them are regular files or nothing."""
    from runtime.checkpoint import LATEST, CheckpointError, latest_step
    from runtime.train.report import CONFIG, METRICS

    errors = []
    for flag, path in (("--save", cfg.checkpoint.save), ("--run-dir", cfg.logging.run_dir),
                       ("--tensorboard-dir", cfg.logging.tensorboard_dir)):
        if path is None:
            continue
        problem = _folder_problem(path)
        if problem:
            errors.append(f"{flag} {path}: {problem}")
            continue
        # the files a run writes in it: each a regular file or nothing (never a FIFO, device or link)
        names = RUN_FILES + (CONFIG, METRICS) if flag == "--run-dir" else ()
        errors += [f"{flag} {path}: {problem}" for problem in
                   (_file_problem(os.path.join(path, name)) for name in names) if problem]
        if flag == "--save" and os.path.isdir(path):
            try:
                latest_step(path)  # a restart resumes from it, and the next save replaces it
            except CheckpointError as e:  # (a folder or a FIFO `latest` is named here)
                errors.append(f"--save {path}: {e}")
            else:  # readable, but the save replaces it: not through a link
                problem = _file_problem(os.path.join(path, LATEST))
                errors += [f"--save {path}: {problem}"] if problem else []
    return errors


def _file_problem(path: str) -> str | None:
    from runtime.files import not_a_file

    what = not_a_file(path)
    return None if what is None else f"{path} is {what}, not a regular file: only regular files are replaced, and " \
                                     "it is left as it is"


def _folder_problem(path: str) -> str | None:
    full = os.path.abspath(path)
    if os.path.lexists(full):
        return None if os.path.isdir(full) else "exists and is not a directory"
    parent = os.path.dirname(full)
    while not os.path.lexists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"cannot be created: {parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created: {parent} is not writable"
    return None


# -- the save directory: one run's at a time ----------------------------------------------------------

def _same_dir(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def holds_checkpoints(directory: str) -> bool:
    """Whether DIRECTORY holds what a save left (a `latest`, or a complete step_N)."""
    from runtime.checkpoint import LATEST, complete_steps

    return os.path.isdir(directory) and (os.path.lexists(os.path.join(directory, LATEST))
                                         or bool(complete_steps(directory)))


def starts_fresh(cfg: TrainConfig) -> bool:
    """--save X --load X where X holds no checkpoint yet (Megatron's habit on a first launch): no load."""
    ck = cfg.checkpoint
    return bool(ck.load and ck.save and _same_dir(ck.load, ck.save) and not holds_checkpoints(ck.save))


def resumes_save_dir(cfg: TrainConfig) -> bool:
    """Whether --load names the --save directory (or one checkpoint in it): a resume, which may save there."""
    from runtime.checkpoint import INFO

    ck = cfg.checkpoint
    if not ck.load or not ck.save:
        return False
    if _same_dir(ck.load, ck.save):
        return True
    return os.path.isfile(os.path.join(ck.load, INFO)) and _same_dir(os.path.dirname(os.path.normpath(ck.load)),
                                                                     ck.save)


def foreign_checkpoints(cfg: TrainConfig) -> str | None:
    """A run that does not resume from its --save directory must not write over the checkpoints in it:
    one line when it holds some (None: it holds none, or this run resumes them)."""
    from runtime.checkpoint import CheckpointError, complete_steps, latest_step

    save = cfg.checkpoint.save
    if not save or resumes_save_dir(cfg) or not holds_checkpoints(save):
        return None
    try:
        step = latest_step(save)
    except CheckpointError:
        step = None
    steps = complete_steps(save)
    step = step if step is not None else (steps[-1] if steps else None)
    what = f"checkpoints (latest step {step})" if step is not None else "checkpoints"
    loads = f" (it loads {cfg.checkpoint.load})" if cfg.checkpoint.load else ""
    return (f"--save {save} holds {what} that this run did not write: a new run{loads} never overwrites them; "
            f"resume them with --load {save}, or give another --save directory")


def save_dir_rules(cfg: TrainConfig) -> list:
    """What the launcher checks before starting any rank: --save is not another run's (its lock is
    free, and it holds no checkpoints unless this run resumes them). Rank 0 decides again when it
    takes the lock (claim_save_dir)."""
    from runtime.checkpoint import CheckpointError, check_free

    save = cfg.checkpoint.save
    if save is None:
        return []
    try:
        check_free(save)
    except CheckpointError as e:
        return [f"--save {save}: {e}"]
    problem = foreign_checkpoints(cfg)
    return [problem] if problem else []


def claim_save_dir(cfg: TrainConfig, rank: int, world: int, restart: int):
    """Every rank calls it (after torch.distributed is initialized, when there are several): rank 0,
    the one that writes `latest`, takes --save's lock for the whole run and decides; the others
    learn its decision. Returns (the lock on rank 0, else None; an error line or None; whether the
    directory's checkpoints are this run's own: an elastic restart of the run that claimed it)."""
    from runtime.checkpoint import CheckpointError, lock_save_dir, run_identity, same_run

    lock, error, own = None, None, False
    save = cfg.checkpoint.save
    if rank == 0 and save:
        try:
            lock = lock_save_dir(save)
            mine = run_identity()
            own = restart > 0 and same_run(lock.previous, mine)
            error = None if own else foreign_checkpoints(cfg)
            if error is None:
                lock.claim(mine)
        except CheckpointError as e:
            error = f"--save {save}: {e}"
        except OSError as e:
            error = f"--save {save}: cannot take the lock of the save directory ({e.strerror or e})"
        if error is not None and lock is not None:
            lock.release()
            lock = None
    if world > 1:
        import torch.distributed as dist

        box = [(error, own)]
        dist.broadcast_object_list(box, src=0)
        error, own = box[0]
    return lock, error, own


def _checkpoint_rules(load: str) -> list:
    """--load: the checkpoint it names must be readable (its `latest` and checkpoint.json)."""
    from runtime.checkpoint import CheckpointError, read_info
    from runtime.checkpoint import resolve as checkpoint_path

    try:
        read_info(checkpoint_path(load))
    except CheckpointError as e:
        return [f"--load {load}: {e}"]
    return []


def tokenizer_rules(cfg: TrainConfig) -> list:
    """--tokenizer-type: build it (its files, its library) and derive the model's vocabulary, the
    tokenizer's padded as Megatron's --make-vocab-size-divisible-by x TP (cfg.data.padded_vocab_size,
    which compile_model sets as vocab_size unless --set vocab_size= gives one)."""
    data = cfg.data
    if data.tokenizer_type is None:
        return []
    tok = build_tokenizer(data.tokenizer_type, vocab_file=data.vocab_file, merge_file=data.merge_file,
                          tokenizer_model=data.tokenizer_model, vocab_size=data.vocab_size,
                          tiktoken_pattern=data.tiktoken_pattern,
                          tiktoken_num_special_tokens=data.tiktoken_num_special_tokens)
    data.padded_vocab_size = vocab_size_with_padding(tok.vocab_size, data.make_vocab_size_divisible_by,
                                                     cfg.parallel.tp)
    data.eod = tok.eod  # --eod-mask-loss's token (eod_rules)
    given = cfg.overrides.get("vocab_size")
    if isinstance(given, int) and given < tok.vocab_size:
        return [f"--set vocab_size={given} is smaller than the {data.tokenizer_type} vocabulary ({tok.vocab_size}); "
                f"drop it to use the padded {data.padded_vocab_size}"]
    return []


def packed_rules(cfg: TrainConfig) -> list:
    """--reset-attention-mask restarts attention in the mask Megatron's data loader builds; with
    --no-create-attention-mask-in-dataloader it builds none and Megatron's documents attend to
    each other, which specc's model compiled for document ids would not do: refused."""
    flag = "--no-create-attention-mask-in-dataloader"
    if cfg.data.reset_attention_mask and any(note.split(":", 1)[0].strip() == flag for note in cfg.notes):
        return [f"--reset-attention-mask with {flag}: Megatron then builds no attention mask, so its reset "
                "does not happen there; drop one of them"]
    return []


def eod_rules(cfg: TrainConfig) -> list:
    """--eod-mask-loss masks Megatron's tokenizer.eod, and --reset-position-ids and
    --reset-attention-mask restart after it: the --tokenizer-type's end-of-document token
    (tokenizer_rules records it), else the one `specc data prepare` recorded beside the data
    (every dataset of the run the same)."""
    data = cfg.data
    flag = "/".join(f for f, on in (("--eod-mask-loss", data.eod_mask_loss),
                                     ("--reset-position-ids", data.reset_position_ids),
                                     ("--reset-attention-mask", data.reset_attention_mask)) if on)
    if not flag:
        return []
    if data.tokenizer_type is not None:
        return [] if data.eod is not None else [
            f"{flag}: the {data.tokenizer_type} tokenizer has no end-of-document token"]
    paths = [data.data_path] if data.data_path is not None else [data.train_data_path, data.valid_data_path,
                                                                  data.test_data_path]
    prefixes = [prefix for path in paths if path is not None for _, prefix in parse_blend(path)]
    if data.mock_data or not prefixes:
        return [f"{flag} needs the end-of-document token's id: give --tokenizer-type ("
                f"{'mock data has no tokenizer' if data.mock_data else 'the default data is byte-tokenized, without one'})"]
    found = {}
    for prefix in prefixes:
        meta = read_sidecar(prefix[:-4] if prefix.endswith((".bin", ".idx")) else prefix) or {}
        found[prefix] = (meta.get("tokenizer") or {}).get("eod")
    ids = set(found.values())
    if None in ids or len(ids) > 1:
        which = ", ".join(f"{p}: {found[p] if found[p] is not None else 'none recorded'}" for p in found)
        return [f"{flag} needs the end-of-document token's id: give --tokenizer-type (the data's "
                f"tokenizers recorded by specc data prepare: {which})"]
    data.eod = ids.pop()
    return []


_ID_RANGES: dict = {}


def _id_range(corpus):
    """The dataset's (smallest, largest) token id, read once per process and file version."""
    path = corpus.prefix + ".bin"
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    if key not in _ID_RANGES:
        _ID_RANGES[key] = corpus.id_range()
    return _ID_RANGES[key]


def split_paths(cfg: TrainConfig) -> dict | None:
    """{split: prefix or blend} for Megatron's --train/--valid/--test-data-path (None: not given)."""
    d = cfg.data
    if d.train_data_path is None:
        return None
    return {"train": d.train_data_path, "valid": d.valid_data_path, "test": d.test_data_path}


def has_data(cfg: TrainConfig) -> bool:
    return cfg.data.data_path is not None or cfg.data.mock_data or cfg.data.train_data_path is not None


def data_rules(cfg: TrainConfig, model_config: dict) -> list:
    """The data opens, every token id in it is inside the model's vocabulary (found now, not
    mid-run), and the splits training reads hold a sample each."""
    vocab = model_config["vocab_size"]
    seq = model_config["seq_length"]
    per_split = split_paths(cfg)
    if per_split is not None:
        sources = {name: open_corpora(path, seq, cfg.seed) for name, path in per_split.items() if path is not None}
    else:
        sources = {None: open_corpora(cfg.data.data_path, seq, cfg.seed, mock=cfg.data.mock_data, vocab_size=vocab)}
    errors = []
    checked = set()
    for split, corpora in sources.items() if not cfg.data.mock_data else ():
        flag = f"--{split}-data-path" if split is not None else "--data-path"  # the flag that named it
        for _, corpus in corpora:
            if corpus.prefix in checked:
                continue
            checked.add(corpus.prefix)
            errors += _vocabulary_rules(corpus, vocab, flag)
    if errors:
        return errors
    needed = {"train": 1, "valid": 1 if cfg.eval_iters > 0 else 0}
    for name, least in needed.items():
        if not least:
            continue
        if per_split is not None and name not in sources:
            errors.append(f"--eval-iters {cfg.eval_iters} evaluates on the valid split: give --valid-data-path "
                          "PREFIX, or --eval-iters 0")
            continue
        seen = set()
        for _, corpus in sources[name if per_split is not None else None]:
            if corpus.prefix in seen:  # a blend may name one prefix twice: one error for it
                continue
            seen.add(corpus.prefix)
            first, end = (0, corpus.num_documents) if per_split is not None else \
                split_documents(corpus.num_documents, split_weights(cfg.data.split))[name]
            tokens = int(corpus.document_lengths[first:end].sum())
            if (tokens - 1) // seq < least:
                where = f"--{name}-data-path {corpus.prefix}: it" if per_split is not None else \
                    f"--data-path {corpus.prefix}: the {name} split (--split {cfg.data.split})"
                errors.append(f"{where} holds {end - first} of its {corpus.num_documents} documents, {tokens} "
                              f"tokens: not one "
                              f"sample of --seq-length {seq} + 1"
                              + ("; set --eval-iters 0 or give it a larger share" if name == "valid" else ""))
    return errors


def _vocabulary_rules(corpus, vocab: int, flag: str = "--data-path") -> list:
    meta = read_sidecar(corpus.prefix)
    if meta is not None and isinstance(meta.get("vocab_size"), int) and meta["vocab_size"] > vocab:
        return [f"{flag} {corpus.prefix}: its tokenizer's vocabulary ({meta['vocab_size']}) is larger than the "
                f"model's vocab_size ({vocab}); set --set vocab_size={meta['vocab_size']} or more, or give its "
                "--tokenizer-type"]
    ids = _id_range(corpus)
    if ids is not None and (ids[0] < 0 or ids[1] >= vocab):
        bad = ids[0] if ids[0] < 0 else ids[1]
        return [f"{flag} {corpus.prefix}: {corpus.prefix}.bin holds token id {bad} "
                f"({'its smallest' if bad < 0 else 'its largest'}), outside the model's vocabulary of {vocab} "
                f"(ids 0..{vocab - 1}); prepare the data with the model's tokenizer, give its --tokenizer-type, or "
                f"--set vocab_size={ids[1] + 1} or more"]
    return []


DEFAULT_DATA = os.path.join("data", "stdlib_text_document")


def default_data(run_dir: str, log=None) -> str:
    """The embedded corpus (the standard library's sources, byte tokenizer) at
    RUN_DIR/data/stdlib_text_document.bin/.idx, prepared once and reused while the same files are there."""
    path = os.path.join(run_dir, DEFAULT_DATA)
    files = stdlib_files()
    meta = read_sidecar(path)
    try:
        if meta is not None and meta["tokenizer"].get("type") == "byte" and \
                [s["path"] for s in meta["sources"]] == files:
            open_corpora(path, 1, 0)  # and the files are whole
            return path
    except (DataError, KeyError, TypeError, AttributeError):
        pass
    prepare(files, "byte", path, log=log)
    return path


def _error_lines(e: Exception) -> list:
    from specc.errors import SpecError

    if isinstance(e, ConfigError):
        return [f"error: {line}" for line in e.lines]
    if isinstance(e, SpecError):
        return [e.format()]
    return [f"error: {e}"]


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
        for line in _error_lines(e):
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
        lines = _error_lines(e)
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
    fresh = starts_fresh(cfg)  # --save X --load X, nothing in X yet
    if fresh:
        load = None
    try:
        if own and latest_step(cfg.checkpoint.save) is not None:
            load = cfg.checkpoint.save
        elif load and is_foreign_megatron_dir(load):  # weights only (--finetune, megatron_load_rules)
            load = megatron_import(cfg, local_rank, world)
        if load:
            info = read_info(checkpoint_path(load))
            weights_only = info.get("optimizer") is None or not info.get("data")
            # --finetune: the weights only; --no-load-optim: also the iteration and data position
            weights_only = weights_only or (cfg.checkpoint.finetune and load == cfg.checkpoint.load)
            skip_optimizer = cfg.checkpoint.no_load_optim and load == cfg.checkpoint.load
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
