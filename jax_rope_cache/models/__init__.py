"""Model-side helpers above the op (numpy only): RoPE tables (tables), what a Hugging Face config says
(config), and the named models (presets)."""
