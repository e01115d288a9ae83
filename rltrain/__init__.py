"""rltrain: RL for language models with exact token normalization."""
