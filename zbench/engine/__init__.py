"""The bundled PPO/GRPO engine: Ray placement, DeepSpeed actor and critic, Hugging Face rollout."""
