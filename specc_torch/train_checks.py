"""What the launcher and every rank check before a step runs, each broken rule one line
(ConfigError gathers them): the resolved configuration against the compiled spec, the folders a
run writes, the save directory that is one run's at a time (claim_save_dir), the checkpoint to
load, the tokenizer, the end-of-document token and the data; and the embedded corpus a run
without --data-path trains on (default_data)."""

from __future__ import annotations

import os

from runtime.data import (
    DataError,
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
    TrainConfig,
    _note,
    model_rules,
    resolve,
    split_weights,
)

from .megatron_ckpt.train import (
    ckpt_format_rules,
    is_foreign_megatron_dir,
    megatron_load_rules,
)
from .train_compile import RUN_FILES, ConfigError, compile_model

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
