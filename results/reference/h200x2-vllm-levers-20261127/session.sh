#!/usr/bin/env bash
# The two vLLM options not yet measured at PPO's share of the reference config (32 sequences per GPU, GSM8K
# prompts, 512 new tokens, the fitted KV cache): vLLM's fused QK-norm + RoPE pass (off by default in vLLM 0.26) and
# the engine without prefix caching (each PPO prompt is sampled once, so no rollout reuses a cached prefix).
# Three pairs, both GPUs at once (benchmarks/vllm_profile.py via the pair step of ../h200x2-rollout32-20261127), each
# variant once on each GPU. From the project root, with the kits of the GPU machine's README on the path:
#   bash results/reference/h200x2-vllm-levers-20261127/session.sh     -> $OUT/host.txt, $OUT/vllm32.jsonl
set -uo pipefail
IN='{"name":"in-process","engine":{}}'
QK='{"name":"qknorm-rope","engine":{"compilation_config":{"pass_config":{"enable_qk_norm_rope_fusion":true}}}}'
NOPC='{"name":"no-prefix-cache","engine":{"enable_prefix_caching":false}}'
pair=results/reference/h200x2-rollout32-20261127/session.sh
export PAIR_TIMEOUT_S=${PAIR_TIMEOUT_S:-420}
bash $pair host
bash $pair pair "$QK" "$IN"
bash $pair pair "$IN" "$NOPC"
bash $pair pair "$NOPC" "$QK"
echo "session done $(date -u +%FT%TZ)"
