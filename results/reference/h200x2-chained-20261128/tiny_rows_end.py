"""Where the GPU test's rows end: the tiny model's 3 prompts x 4 samples, 24 tokens at temperature 1, seeds 0-2, on
the CPU (the eager loop); prints each row's first EOS token index. Run from the repository root:
    python results/reference/h200x2-chained-20261128/tiny_rows_end.py > results/reference/h200x2-chained-20261128/tiny-rows-end.txt"""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from zbench.data import synthetic_problems
from zbench.engine.batches import left_pad
from zbench.engine.rollout import GraphDecoder
from zbench.models import resolve_model, special_ids

path = resolve_model("tiny")
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(path)
pad_id, eos_ids = special_ids(path)
rows = synthetic_problems(6, seed=3, split="test")  # as tests/test_rollout.py's tiny_loaded
texts = [tok.apply_chat_template(list(r["prompt"]), add_generation_prompt=True, tokenize=False) for r in rows]
ids = [tok.encode(t, add_special_tokens=False) for t in texts]
ids[1], ids[4] = ids[1][3:], ids[4][5:]
input_ids, mask = left_pad(ids, pad_id, multiple=1)
ids3, mask3 = input_ids[:3].repeat_interleave(4, 0), mask[:3].repeat_interleave(4, 0)
print(f"eos ids {eos_ids}, vocabulary {model.config.vocab_size}")
for seed in range(3):
    decoder = GraphDecoder(model, compile=False, attention="sdpa")
    out = decoder.generate(ids3, mask3, max_new_tokens=24, temperature=1.0, top_p=1.0, pad_id=pad_id, eos_ids=eos_ids,
                           generator=torch.Generator().manual_seed(seed), samples=4)
    ends = [int(torch.isin(row, torch.tensor(eos_ids)).nonzero()[0]) if torch.isin(row, torch.tensor(eos_ids)).any()
            else None for row in out]
    print(f"seed {seed}: first EOS at token {ends}")
