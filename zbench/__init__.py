"""zbench: which DeepSpeed ZeRO configuration to use for RL post-training, and what each one costs."""

__version__ = "0.1.0"
