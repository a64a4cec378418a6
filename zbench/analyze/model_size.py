"""How big a case's model is, as transformers builds it: the model made from its own config on the meta device
(shapes only: no weights, no memory), so any causal-LM architecture is counted exactly as it will be trained."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class ModelSize:
    """Parameters of a model, tied ones counted once, and of its largest single module (what ZeRO-3 gathers)."""

    architecture: str
    n_params: int
    largest_module_params: int


def _where(spec: str, base_dir: Path | None) -> str:
    """`spec` itself for an embedded model, else the model directory it names (relative paths from `base_dir`)."""
    from zbench.models import PACKAGED, SHAPE_PRESETS

    if spec == "tiny" or spec in SHAPE_PRESETS or spec in PACKAGED:
        return spec
    path = Path(spec).expanduser()
    if not path.is_absolute() and base_dir is not None and (Path(base_dir) / path).is_dir():
        path = Path(base_dir) / path
    return str(path)


def model_config(spec: str, base_dir: Path | None = None):
    """The transformers config of `model.path`: an embedded model (tiny, a shape preset), a packaged checkpoint
    (read from its GGUF file's header, nothing converted) or a local model directory (relative paths from
    `base_dir`)."""
    from transformers import AutoConfig

    from zbench.models import PACKAGED, SHAPE_PRESETS, TinyRecipe, build_tokenizer, packaged_file, tiny_config

    if spec == "tiny":  # its vocabulary is the trained tokenizer's (a second or two), not the recipe's target
        recipe = TinyRecipe()
        return tiny_config(recipe, build_tokenizer(recipe))
    if spec in SHAPE_PRESETS:
        return SHAPE_PRESETS[spec]()
    if spec in PACKAGED:
        gguf, _ = packaged_file(spec)
        return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    path = Path(_where(spec, base_dir))
    if not (path / "config.json").is_file():
        what = "is not a directory" if not path.is_dir() else "has no config.json"
        raise ValueError(f"model.path {spec!r}: {path} {what}; give 'tiny', "
                         f"{', '.join(repr(n) for n in [*SHAPE_PRESETS, *PACKAGED])} or a local Hugging Face model directory")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, OSError, KeyError) as err:
        raise ValueError(f"model.path {spec!r}: transformers cannot read {path / 'config.json'}: {err}") from None


def model_size(spec: str, base_dir: Path | None = None) -> ModelSize:
    """Count the parameters of `model.path` from a meta-device instance of its causal-LM class (once per model,
    however many cases name it)."""
    where = _where(spec, base_dir)
    try:
        return _count(where)
    except ValueError as err:  # name the model as the config did
        raise ValueError(str(err).replace(repr(where), repr(spec), 1)) from None


@functools.lru_cache(maxsize=16)
def _count(spec: str) -> ModelSize:
    import torch
    from transformers import AutoModelForCausalLM

    config = model_config(spec)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except ValueError as err:
        raise ValueError(f"model.path {spec!r} ({config.model_type}) is not a causal language model that "
                         f"transformers can build: {str(err).splitlines()[0]}") from None
    n = sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return ModelSize(type(model).__name__, int(n), int(largest))
