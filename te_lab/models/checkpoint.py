"""A user's own checkpoint, loaded from disk, never from the network: a Hugging Face
checkpoint folder (``config.json`` and safetensors, as ``save_pretrained`` writes them) or
a ``.gguf`` file through transformers' GGUF loader (dequantized to ``dtype``).

Every way it can fail says what to do: a path that does not exist, a folder without
``config.json``, a checkpoint that is not a causal language model, a missing optional
package (transformers, gguf).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from te_lab import device as devices


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded, with what to do about it."""


def is_checkpoint_path(value: str) -> bool:
    """Whether ``value`` names a checkpoint on disk (an existing folder or a ``.gguf``
    path) rather than one of te_lab's model names."""
    return value.lower().endswith(".gguf") or Path(value).is_dir() or os.sep in value


def _transformers(path: Path) -> Any:
    if importlib.util.find_spec("transformers") is None:
        raise CheckpointError(f"loading {path} needs the transformers package: pip install 'te_lab[hf]'")
    import transformers

    return transformers


def _from_folder(path: Path, dtype: torch.dtype):
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} has no config.json: pass a folder that save_pretrained wrote (config.json "
                              f"and *.safetensors) or a .gguf file")
    transformers = _transformers(path)
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except ValueError as error:
        if type(config).__name__ not in str(error):
            raise
        architectures = ", ".join(getattr(config, "architectures", None) or [type(config).__name__])
        raise CheckpointError(f"{path} holds a {architectures} checkpoint, which is not a causal language model "
                              f"(transformers' AutoModelForCausalLM has no class for {type(config).__name__})") \
            from None


def _from_gguf(path: Path, dtype: torch.dtype):
    transformers = _transformers(path)
    if importlib.util.find_spec("gguf") is None:
        raise CheckpointError(f"loading {path} needs the gguf package, which transformers reads .gguf files "
                              f"with: pip install gguf")
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype,
                                                             local_files_only=True)


def load_checkpoint(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                    device: Optional[devices.DeviceLike] = None) -> nn.Module:
    """The causal LM saved at ``path`` (a checkpoint folder or a ``.gguf`` file) in
    ``dtype`` on ``device`` (default: te_lab's default device), in eval mode as
    ``from_pretrained`` leaves it (dropout off: fused and unfused steps compare exactly)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist: pass a folder that save_pretrained wrote "
                              f"or a .gguf file")
    model = _from_gguf(path, dtype) if path.suffix.lower() == ".gguf" else _from_folder(path, dtype)
    return model.to(devices.resolve(device))
