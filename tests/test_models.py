"""Model builders: the cached, reproducible tiny model, its tokenizer, the Qwen3-0.6B shape, resolve_model."""

import json
import multiprocessing
import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from zbench.data import INSTRUCTION, synthetic_problems
from zbench.engine.reward import compute_score
from zbench.models import (
    TinyRecipe,
    build_tiny,
    build_tokenizer,
    qwen3_06b_config,
    resolve_model,
)

# The real recipe takes minutes on two cores; the mechanics are the same with a few warm-start steps.
QUICK = TinyRecipe(tokenizer_texts=300, sft_steps=8, sft_batch=8)


def _weights(path):
    return load_file(str(path / "model.safetensors"))


def test_tiny_build_is_cached_and_reproducible(tmp_path):
    first = build_tiny(tmp_path / "a", recipe=QUICK)
    stamp = (first / ".complete").stat().st_mtime_ns
    assert build_tiny(tmp_path / "a", recipe=QUICK) == first  # second call: cache hit, no rebuild
    assert (first / ".complete").stat().st_mtime_ns == stamp
    second = build_tiny(tmp_path / "b", recipe=QUICK)
    assert first.name == second.name and first.name.startswith("tiny-")
    a, b = _weights(first), _weights(second)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (first / "tokenizer.json").read_text() == (second / "tokenizer.json").read_text()
    assert json.loads((first / "zbench_recipe.json").read_text())["sft_steps"] == QUICK.sft_steps
    assert build_tiny(tmp_path / "a", recipe=TinyRecipe(tokenizer_texts=300, sft_steps=9, sft_batch=8)).name \
        != first.name
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.endswith(".tmp")]


def _build_in_child(cache):
    return str(build_tiny(cache, recipe=QUICK))


def test_concurrent_builds_build_once(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        paths = pool.map(_build_in_child, [tmp_path, tmp_path])
    assert paths[0] == paths[1]
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == [paths[0].rsplit("/", 1)[-1]]


def test_tokenizer_round_trip_digits_and_chat_template():
    tok = build_tokenizer(QUICK)
    assert 256 < len(tok) <= QUICK.vocab_size
    text = 'Tom has 12 apples. 12 + 305 = 317\n#### 317 The answer is 317. Unseen: é€ 😀'
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    pieces = tok.convert_ids_to_tokens(tok("12 + 305", add_special_tokens=False)["input_ids"])
    assert [p for p in pieces if any(c.isdigit() for c in p)] == ["1", "2", "3", "0", "5"]
    messages = synthetic_problems(1, 0, "test")[0]["prompt"]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == f"<|im_start|>user\n{messages[0]['content']}<|im_end|>\n<|im_start|>assistant\n"
    assert prompt.rstrip().endswith("assistant") and INSTRUCTION in prompt
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.pad_token_id != tok.eos_token_id


def test_saved_tiny_model_loads_and_generates(tmp_path):
    path = build_tiny(tmp_path, recipe=QUICK)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    cfg = model.config
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == ("qwen3", 64, 2, 4)
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size) == (2, 16, 192)
    assert cfg.tie_word_embeddings and cfg.vocab_size == len(tok) and cfg.max_position_embeddings == 512
    assert model.generation_config.eos_token_id == tok.eos_token_id
    enc = tok.apply_chat_template([{"role": "user", "content": "Tom has 3 apples."}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    out = model.generate(**enc, max_new_tokens=4, do_sample=False)
    assert out.shape[1] <= enc["input_ids"].shape[1] + 4


def test_qwen3_06b_config_parameter_count():
    config = qwen3_06b_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n_params = sum(p.numel() for p in model.parameters())  # tied embedding counted once
    assert n_params == 596_049_920
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (28, 1024, 16)
    assert (config.num_key_value_heads, config.head_dim, config.intermediate_size) == (8, 128, 3072)
    assert config.vocab_size == 151936 and config.tie_word_embeddings
    assert config.rope_parameters["rope_theta"] == 1e6 and config.max_position_embeddings == 40960


def test_resolve_model_local_dir_and_errors(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path
    with pytest.raises(ValueError, match=r"has no config\.json"):
        resolve_model(str(tmp_path.parent))
    with pytest.raises(ValueError, match=r"is not a directory; give 'tiny', 'qwen3-0\.6b'"):
        resolve_model(str(tmp_path / "missing"))


@pytest.mark.slow
def test_default_tiny_recipe_builds_and_answers():
    """The real default recipe, built once into the cache every case reads it from (its key hashes the recipe, so
    this is the recipe's own build): answers mostly right, partly as '#### N'."""
    start = time.time()
    path = resolve_model("tiny")
    build_s = time.time() - start
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path)
    rows = synthetic_problems(64, seed=5, split="test")
    prompts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=32, do_sample=True, temperature=1.0, top_p=1.0)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    truths = [r["reward_model"]["ground_truth"] for r in rows]
    strict = sum(compute_score(t, g, "strict", format_score=0.1) for t, g in zip(texts, truths, strict=True))
    flexible = sum(compute_score(t, g, "flexible") for t, g in zip(texts, truths, strict=True))
    print(f"\nbuilt or found in {build_s:.0f}s, strict score {strict / 64:.3f}, flexible accuracy {flexible / 64:.3f}")
    assert 0.05 <= strict / 64 <= 0.5
    assert flexible / 64 >= 0.5
