"""Models: the built-in models, Hugging Face transformers (with peft adapters), LoRA, ScatterNet features and losses."""
