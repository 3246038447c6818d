"""The target-model errors that are the user's to fix: every command prints their one-line message (exit status 2)."""

from __future__ import annotations


class ModelError(ValueError):
    """A target model spd-ds cannot use as given (the message is one line and says what to change)."""


class UnsupportedModelError(ModelError):
    """The checkpoint's architecture is not one spd-ds can split into stages."""


class ModelFileError(ModelError):
    """A model directory whose files cannot be read (config.json, safetensors, tokenizer, generation config), or whose
    tensors do not match its config."""
