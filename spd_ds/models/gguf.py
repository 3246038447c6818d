"""GGUF checkpoints -> float32 safetensors HF model directories (how :mod:`spd_ds.zoo` makes its models).

The registry packages of the model zoo carry GGUF files; :func:`convert_gguf` turns one into an ordinary HF model
directory once, which everything downstream loads like any other.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path

from spd_ds.cli import notice

logger = logging.getLogger(__name__)

MARKER = "SPD_DS_CONVERTED.json"  # written last: a converted directory without it is redone

_QUIET_LOCK = threading.Lock()
_quiet: dict = {"depth": 0, "saved": None}


def _quiet_bars(gguf_utils, hf_logging, step: int) -> None:
    """Switch transformers' progress bars (its own switch, huggingface_hub's, and the GGUF tensors' plain tqdm) off
    for the first of concurrent conversions (``step=+1``) and back to what they were after the last (``step=-1``):
    conversions in threads of one process must not restore each other's patched state."""
    from huggingface_hub import utils as hub_utils

    with _QUIET_LOCK:
        if step > 0 and _quiet["depth"] == 0:
            gguf_bar = getattr(gguf_utils, "tqdm", None)
            _quiet["saved"] = (hf_logging.is_progress_bar_enabled(), hub_utils.are_progress_bars_disabled(), gguf_bar)
            hf_logging.disable_progress_bar()  # transformers' own (loading the weights)
            if gguf_bar is not None:
                gguf_utils.tqdm = functools.partial(gguf_bar, disable=True)
        _quiet["depth"] += step
        if step < 0 and _quiet["depth"] == 0:
            hf_on, hub_off, gguf_bar = _quiet["saved"]
            if hf_on:
                hf_logging.enable_progress_bar()  # (switches huggingface_hub's on too: put back what it was below)
            (hub_utils.disable_progress_bars if hub_off else hub_utils.enable_progress_bars)()
            if gguf_bar is not None:
                gguf_utils.tqdm = gguf_bar
            _quiet["saved"] = None


def convert_gguf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    eos_token: str | None = None,
    extra_eos_tokens: tuple[str, ...] | list[str] = (),
    chat_template: str | None = None,
    source: str | None = None,
    name_or_path: str | None = None,
) -> Path:
    """Convert a GGUF checkpoint into a float32 safetensors HF model directory.

    The weights are dequantised by transformers (``gguf_file=`` with ``GgufConfig(dequantize=True)``),
    the tokenizer is rebuilt from the GGUF metadata, and model, generation config and tokenizer are saved
    with ``save_pretrained``. The output is written to a temporary sibling directory whose marker file
    (:data:`MARKER`) is written last; it is then renamed into place, so ``out_dir`` is either complete
    or absent. No locking here: :func:`resolve_model` holds the lock.

    Args:
        gguf_path: the ``.gguf`` file.
        out_dir: destination directory (replaced if it exists).
        eos_token: token to force as the tokenizer's / generation config's EOS (e.g. ``<|im_end|>``).
        extra_eos_tokens: further stop tokens for the generation config (``eos_token_id`` becomes a list).
        chat_template: Jinja template used only if the GGUF has none.
        source: free text recorded in the marker file.
        name_or_path: recorded as the config's ``_name_or_path`` (the GGUF's own name is often a
            training-run label).

    Progress: a bar on stderr when it is a terminal or a Jupyter kernel's; otherwise (a log file, no stderr) no bars,
    transformers' included, and one ``spd_ds: converted ... in N s`` line at the end (logged without stderr).

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`.

    Raises:
        ~spd_ds.zoo.ModelUnavailableError: the GGUF file does not exist.
        RuntimeError: transformers left quantised (non-float32) weights in the model.
    """
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    from spd_ds.zoo import ModelUnavailableError

    gguf = Path(gguf_path).expanduser().resolve()
    if not gguf.is_file():
        raise ModelUnavailableError(f"GGUF file {gguf} does not exist")
    out = Path(out_dir).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)

    load_kwargs: dict = {"gguf_file": gguf.name, "dtype": torch.float32}
    try:  # transformers >= 5 with the GGUF quantiser: ask for plain dense weights explicitly
        from transformers import GgufConfig

        load_kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older releases always dequantise GGUF files
        pass

    t0 = time.perf_counter()
    steps = ["load + dequantise weights", "tokenizer", "save safetensors"]
    # progress bars only on a terminal: in a log file every redraw is a line of carriage returns and escape codes
    try:  # (a pythonw or service process has no stderr: sys.stderr is None; a replacement may lack isatty)
        interactive = bool(sys.stderr.isatty())
    except (AttributeError, ValueError):  # ValueError: a closed stream
        interactive = False
    # a Jupyter kernel's stderr is no terminal but draws bars (tqdm.auto's widgets)
    interactive = interactive or type(sys.stderr).__module__.startswith("ipykernel")
    bar = tqdm(total=len(steps), desc=f"spd_ds: converting {gguf.name}", unit="step", leave=True,
               disable=not interactive)
    if not interactive:  # (the caller says that it converts: spd_ds.zoo)
        _quiet_bars(gguf_utils, hf_logging, +1)
    try:
        bar.set_postfix_str(steps[0])
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), **load_kwargs)
        bad = [n for n, p in model.named_parameters() if p.dtype != torch.float32 or type(p.data) is not torch.Tensor]
        if bad or getattr(model.config, "quantization_config", None) is not None:
            raise RuntimeError(
                f"transformers kept GGUF-quantised weights for {gguf.name} (e.g. {bad[:1]}); "
                "a transformers release that dequantises GGUF files is needed"
            )
        if name_or_path:  # the GGUF loader stores general.name (often a training-run label) there
            model.config._name_or_path = name_or_path
            if hasattr(model.config, "_model_name_or_path"):
                model.config._model_name_or_path = name_or_path
        eps = getattr(model.config, "rms_norm_eps", None)
        if isinstance(eps, float):  # GGUF stores float32: 1e-5 comes back as 9.99999974e-06
            model.config.rms_norm_eps = float(f"{eps:.6g}")
        bar.update(1)

        bar.set_postfix_str(steps[1])
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        if eos_token is not None and tok.eos_token != eos_token:
            logger.warning("GGUF tokenizer EOS is %r; forcing %r", tok.eos_token, eos_token)
            tok.eos_token = eos_token
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        if not getattr(tok, "chat_template", None):
            if chat_template is None:
                logger.warning("%s carries no chat template and none was given", gguf.name)
            else:
                tok.chat_template = chat_template
        max_pos = getattr(model.config, "max_position_embeddings", None)
        if max_pos:
            tok.model_max_length = int(max_pos)
        # EOS / PAD / BOS ids consistent between tokenizer, config and generation config.
        ids = {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id}
        for key, value in ids.items():
            if value is not None:
                setattr(model.config, key, value)
                if model.generation_config is not None:
                    setattr(model.generation_config, key, value)
        if extra_eos_tokens and model.generation_config is not None:
            extra = [tok.convert_tokens_to_ids(t) for t in extra_eos_tokens]
            if any(i is None or i == tok.unk_token_id for i in extra):
                raise RuntimeError(f"{gguf.name}: unknown stop token among {list(extra_eos_tokens)}")
            model.generation_config.eos_token_id = [tok.eos_token_id] + [i for i in extra if i != tok.eos_token_id]
        bar.update(1)

        bar.set_postfix_str(steps[2])
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        if not list(tmp.glob("*.safetensors")):
            raise RuntimeError(f"save_pretrained wrote no safetensors file into {tmp}")
        import transformers

        info = {
            "source": source or str(gguf),
            "gguf": gguf.name,
            "gguf_bytes": gguf.stat().st_size,
            "dtype": "float32",
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "seconds": round(time.perf_counter() - t0, 1),
        }
        for f in tmp.iterdir():  # safetensors writes 0600 files; make the cache readable like the rest
            f.chmod(0o644)
        (tmp / MARKER).write_text(json.dumps(info, indent=1) + "\n")  # last: marks the directory complete
        bar.update(1)

        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        bar.close()
        if not interactive:
            _quiet_bars(gguf_utils, hf_logging, -1)
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    done = f"spd_ds: converted {gguf.name} -> {out} in {time.perf_counter() - t0:.1f} s"
    if interactive:  # the bar said it
        logger.info(done)
    else:  # to stderr, or to the log where it is missing or closed (the conversion is done: nothing may raise)
        notice(done, logger)
    return out
